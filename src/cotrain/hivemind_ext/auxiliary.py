"""Auxiliary reducers: a public peer that reduces all-reduce parts for the others, with weight 0.

A peer behind NAT joins as a client (hivemind's client mode): it sends its parts and receives the averages,
but nobody can dial it, so it reduces nothing, and a group of clients alone cannot average at all. A public
machine (the monitor's VM first of all) takes part in their all-reduces as hivemind's auxiliary peer
(``AveragingMode.AUX``): it looks for groups like a full peer (clients join it as their group's leader), the
all-reduce's load balancing gives it a share of the vector like any full peer, and it reduces the parts the
senders send it and returns their averages; it sends nothing of its own and adds no weight.

- ``GradientReducer`` (sync): an auxiliary ``SwarmOptimizer`` (hivemind.Optimizer with ``auxiliary=True``),
  stepped a few times a second: it pre-schedules its gradient rounds and its state-averaging rounds by the
  swarm's progress, as the trainers do;
- ``RoundReducer`` (diloco): the round's averager (cotrain.hivemind_ext.outer.round_averager) built as the
  trainers build theirs, in auxiliary mode, which looks for the group of the round that the most trainers are
  in (``round_to_reduce``) as its end nears. A reducer of sparse records carries what re-encoding its spans'
  averages left out into the next average it reduces of the same values
  (cotrain.hivemind_ext.reducers.RecordParts).

A reducer takes part while the swarm has at least two trainers, one of them a client (``needed``). An
auxiliary peer publishes no progress (hivemind's tracker reports none for a peer that never accumulates
samples), so the trainers do not count it among the swarm's peers; it sends ``AUX_GATHER`` at matchmaking,
and a group's size as the trainers report it counts the members that contributed (``contributors``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from cotrain.algorithms.lineage import round_bits
from cotrain.hivemind_ext.liveness import cancel_controls
from cotrain.hivemind_ext.outer import round_expiration

logger = logging.getLogger(__name__)

AUX_GATHER = {"auxiliary": True}  # what an auxiliary reducer sends its group at matchmaking
TICK = 0.2  # seconds between an auxiliary reducer's looks at the swarm's progress
REMEMBERED = 64  # rounds back that a reducer remembers having reduced (a round is reduced once)
NOT_STARTED = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)


def is_auxiliary(item: Any) -> bool:
    """Whether a group member's gathered data is an auxiliary reducer's."""
    return isinstance(item, dict) and item.get("auxiliary") is True


def contributors(gathered: dict) -> int:
    """The members of a group (``gathered``: member -> what it sent at matchmaking) that contributed: all but
    the auxiliary reducers."""
    return sum(not is_auxiliary(item) for item in gathered.values())


def needed(progress: Any) -> bool:
    """Whether the swarm (hivemind's GlobalTrainingProgress) needs an auxiliary reducer now: at least two
    trainers, at least one of them a client. One trainer alone averages with nobody (a reducer would only echo
    its change back), and full peers reduce for each other."""
    return progress.num_peers >= 2 and progress.num_clients >= 1


def round_to_reduce(epochs: list[int]) -> int | None:
    """The round an auxiliary reducer looks for a group in, given the trainers' rounds (``epochs``, one per
    trainer): the round the most of them are in, the latest of rounds with as many; None without trainers.
    Following the swarm's round (the furthest trainer's) instead, a reducer served a lone leader, for whom it
    only echoes its own change back, while the clients a round behind it had nobody to reduce for them, and
    stayed behind round after round (measured: two of three clients through a monitor in no group of two for
    18 rounds)."""
    if not epochs:
        return None
    counts = Counter(epochs)
    return max(counts, key=lambda round_: (counts[round_], round_))


def follow(tracker: Any, epoch: int) -> None:
    """Move a reducer's progress tracker to the swarm's ``epoch`` (nothing is published: no samples)."""
    if epoch > tracker.local_progress.epoch:
        with tracker.pause_updates():
            tracker.update_epoch(epoch)


class Reducer(threading.Thread):
    """An auxiliary reducer's loop: ``tick`` every TICK seconds until ``close``. ``rounds``: (rounds it took
    part in, rounds that failed)."""

    what = "all-reduce rounds"

    def __init__(self) -> None:
        super().__init__(daemon=True, name="auxiliary-reducer")
        self._closed = threading.Event()

    @property
    def rounds(self) -> tuple[int, int]:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        last = ""
        while not self._closed.wait(TICK):
            try:
                self.tick()
            except Exception as e:  # network trouble degrades: the next tick tries again (said once)
                problem = f"Auxiliary reducer: {type(e).__name__}: {e}"
                if not self._closed.is_set():
                    logger.log(logging.DEBUG if problem == last else logging.WARNING, problem)
                last = problem

    def close(self) -> None:
        self._closed.set()
        self.cancel_rounds()  # a tick waiting on a round returns
        if self.is_alive():
            self.join(timeout=5)
        self.shutdown()

    def cancel_rounds(self) -> None:
        """Cancel the rounds in progress (nothing by default: a tick that waits looks at ``_closed``)."""

    def shutdown(self) -> None:
        raise NotImplementedError


class GradientReducer(Reducer):
    """The sync strategy's auxiliary reducer: ``opt`` is a SwarmOptimizer built with ``auxiliary=True``."""

    what = "gradient rounds"

    def __init__(self, opt: Any) -> None:
        super().__init__()
        self.opt = opt

    @property
    def rounds(self) -> tuple[int, int]:
        return self.opt.rounds_averaged, self.opt.rounds_failed

    def tick(self) -> None:
        opt = self.opt
        if not needed(opt.tracker.global_progress):
            return
        swarm = opt.tracker.global_epoch
        if opt.local_epoch < swarm:  # back from idle: the swarm's step, not a past one's
            opt.state_averager.local_epoch = swarm
            follow(opt.tracker, swarm)
        opt.step()

    def cancel_rounds(self) -> None:
        cancel_controls(self.opt.scheduled_grads, self.opt.scheduled_state)

    def shutdown(self) -> None:
        self.opt.shutdown()


class RoundReducer(Reducer):
    """The diloco strategy's auxiliary reducer: ``averager`` is the run's round averager in auxiliary mode,
    ``tracker`` a progress tracker of the run's rounds (it reports none: it never accumulates samples)."""

    what = "outer rounds"

    def __init__(
        self, averager: Any, tracker: Any, matchmaking_time: float, averaging_timeout: float
    ) -> None:
        super().__init__()
        self.averager, self.tracker = averager, tracker
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.rounds_averaged = self.rounds_failed = 0
        self.reduced: set[int] = set()  # the rounds it reduced in (the last REMEMBERED of them)

    @property
    def rounds(self) -> tuple[int, int]:
        return self.rounds_averaged, self.rounds_failed

    def _round(self) -> int | None:
        """The round to reduce now (``round_to_reduce`` of the trainers' last records)."""
        return round_to_reduce(self.tracker.other_epochs())

    def tick(self) -> None:
        tracker = self.tracker
        follow(tracker, tracker.global_epoch)
        round_ = self._round()
        if round_ is None or round_ in self.reduced or not needed(tracker.global_progress):
            return
        # as the trainers do: look for the round's group a matchmaking time before its expected end (a round
        # behind the swarm's is ending now: its trainers are the ones that reached its end late)
        eta = tracker.estimated_next_update_time if round_ >= tracker.global_epoch else get_dht_time()
        if eta - get_dht_time() > self.matchmaking_time:
            return
        self.averager.set_group_bits(round_bits(round_))
        control = self.averager.step(
            gather=AUX_GATHER,
            scheduled_time=round_expiration(eta, self.matchmaking_time, self.averaging_timeout),
            timeout=self.averaging_timeout,
            wait=False,
        )
        deadline = time.monotonic() + self.averaging_timeout + self.matchmaking_time
        while not control.done() and time.monotonic() < deadline and not self._closed.is_set():
            # the trainers went on to a later round while this reducer still waited for a group: look there
            later = self._round()
            if later is not None and later > round_ and control.stage in NOT_STARTED:
                break
            time.sleep(0.05)
        if not control.done():
            control.cancel()
            return
        try:
            gathered, _ = control.result(0)
        except BaseException as e:  # no group formed, a member left mid-round: the trainers retry or go on
            logger.debug(f"Auxiliary reducer: round {round_} failed ({type(e).__name__}: {e})")
            self.rounds_failed += 1
            return
        self.rounds_averaged += 1
        self.reduced = {r for r in self.reduced if r > round_ - REMEMBERED} | {round_}
        logger.debug(f"Auxiliary reducer: reduced round {round_} for {len(gathered)} peers")

    def shutdown(self) -> None:
        for part in (self.tracker, self.averager):
            try:
                part.shutdown()
            except Exception as e:
                logger.debug(f"{type(part).__name__} shutdown: {e!r}")
