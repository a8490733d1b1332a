"""A round that waits for peers that are gone ends within a matchmaking time, not at its timeout.

hivemind's matchmaking looks for a group until the round's deadline (``--averaging-timeout``), since a group
needs two peers: when the only partner of a trainer dies during a step, the round already looking for a
group (a pre-scheduled gradient round, or the background parameter round of the step before) waits the whole
timeout for it, and the next step waits for that round. The dead partner's progress record keeps it counted
for a minute, so every step would wait so (cotrain.hivemind_ext.progress leaves it out after a round that
found nobody).

``WatchedRounds`` sits right before ``DecentralizedAverager`` in an averager's bases, so that it sees every
round the averager begins, whichever way hivemind begins it (``GradientAverager.schedule_step`` and
``TrainingStateAverager``'s background step both call ``super().step``; tests/live/test_leaving.py checks that
both rounds are seen). ``RoundWatch`` (one thread per optimizer) looks at those rounds every second: one still
looking for a group a matchmaking time (plus ``GRACE``) after its scheduled start has found nobody so far, so
the watch pings the other peers the progress counts (``forget_gone_peers``); when none is left, every such
round is cancelled and the peer steps alone (hivemind falls back to its local gradients, and to its own
parameters). While some peer answers, nothing is cancelled: it may still join.

A round that only its own peers can join (DiLoCo's: the matchmaking key carries the round) also ends when
``left_behind`` says that every other peer has gone past it: a trainer that reached the end of its round
after its group had formed would otherwise look for that group until the averaging timeout, and start every
later round that much behind the others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time

from cotrain.hivemind_ext.hooks import Averager
from cotrain.hivemind_ext.progress import PING_TIMEOUT, SwarmProgressTracker, forget_gone_peers

logger = logging.getLogger(__name__)

WATCH_PERIOD = 1.0  # seconds between looks at the rounds in progress
GRACE = 1.0  # seconds past a matchmaking time before a round that found nobody counts as waiting for nobody

_rounds_lock = threading.Lock()


class WatchedRounds(Averager):
    """An averager that remembers the rounds it begins (see the module's doc)."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().step(*args, **kwargs)
        if isinstance(result, StepControl):
            with _rounds_lock:
                rounds = [c for c in self.__dict__.get("_watched_rounds", ()) if not c.done()]
                self._watched_rounds = [*rounds, result]
        return result

    def rounds_looking_for_group(self, for_longer_than: float) -> list[StepControl]:
        """The rounds in progress still looking for a group ``for_longer_than`` seconds past their scheduled
        start."""
        now = get_dht_time()
        with _rounds_lock:
            rounds = list(self.__dict__.get("_watched_rounds", ()))
        return [
            c
            for c in rounds
            if not c.done()
            and c.stage == AveragingStage.LOOKING_FOR_GROUP
            and now > c.scheduled_time + for_longer_than
        ]


class RoundWatch(threading.Thread):
    """Cancels the rounds of ``averagers`` that look for a group when no other peer of the swarm answers."""

    def __init__(
        self,
        averagers: Sequence[WatchedRounds],
        tracker: Any,
        dht: Any,
        matchmaking_time: float,
        should_stop: Callable[[], bool],
        left_behind: Callable[[], bool] = lambda: False,
    ):
        super().__init__(daemon=True, name="round-watch")
        self.averagers, self.tracker, self.dht = list(averagers), tracker, dht
        self.waited_for = matchmaking_time + GRACE
        self.should_stop, self.left_behind = should_stop, left_behind
        self.cancelled = 0  # rounds cancelled so far
        self._closed = threading.Event()

    def run(self) -> None:
        while not self._closed.wait(WATCH_PERIOD):
            try:
                self.look()
            except Exception as e:  # the averagers or the DHT are shutting down: nothing to watch
                logger.debug(f"watching the averaging rounds failed: {e!r}")

    def look(self) -> int:
        """One look: cancel the rounds that wait for nobody; returns how many were cancelled."""
        stuck = [c for a in self.averagers for c in a.rounds_looking_for_group(self.waited_for)]
        if not stuck or self.should_stop():
            return 0
        if self.left_behind():
            return self._stop_rounds(stuck, "Every other peer has gone past this round")
        forget_gone_peers(self.tracker, self.dht, PING_TIMEOUT)
        # someone answers (client-mode peers counted too), or this tracker cannot tell: it may still join
        if not isinstance(self.tracker, SwarmProgressTracker) or self.tracker.others(clients=True):
            self._closed.wait(PING_TIMEOUT)  # and no ping storm while it does
            return 0
        return self._stop_rounds(stuck, "No other peer of the swarm answers")

    def _stop_rounds(self, stuck: list[StepControl], why: str) -> int:
        cancelled = 0
        for control in stuck:
            if not control.done():
                control.cancel()
                cancelled += 1
        if cancelled:
            self.cancelled += cancelled
            logger.info(
                f"{why}: {cancelled} averaging round(s) stop looking for a group, and this peer steps alone"
            )
        return cancelled

    def close(self) -> None:
        self._closed.set()


def cancel_controls(*controls: Any) -> None:
    """Cancel the averaging rounds (hivemind StepControls, or None) that have not ended, so that a step
    waiting on one returns (a control that is ending already is left to end)."""
    for control in controls:
        try:
            if control is not None and not control.done():
                control.cancel()
        except Exception as e:
            logger.debug(f"cancelling an averaging round: {e!r}")
