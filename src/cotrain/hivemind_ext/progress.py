"""The swarm's progress toward the next global step (or DiLoCo round), robust to peers that lie about theirs.

hivemind's ``ProgressTracker`` sums the samples every peer reports for the current epoch and takes the
largest epoch any full peer reports as the swarm's. A peer that claims a million samples forces the step
at once (and would weigh a million in the average); one that claims epoch 10**6 sends every honest peer to
download a state that does not exist. ``RobustProgressTracker`` (with ``--aggregation centered-clip``)
counts what a minority cannot inflate:

- a peer's samples count at most ``PROGRESS_CAP`` times the median of the samples reported for the epoch
  over every peer, one not at the epoch yet counting 0 (and its samples per second, which set the estimated
  time of the step, at most ``PROGRESS_CAP`` times the median rate): one liar moves the step no earlier than
  an honest peer twice the median's speed would;
- an epoch ahead of this peer's next one counts as the swarm's only when at least two full peers report
  it (or reached beyond it): a lone peer far ahead is ignored;
- a peer that downloads the state asks no donor beyond the epoch that two other full peers reached
  (``witnessed_epoch``, applied by cotrain.hivemind_ext.statecheck) while a donor within it serves: otherwise
  a newcomer or a lagging peer would take a lone liar's epoch and become its second witness.

The all-reduce's weights are capped at their median by the reducers (cotrain.hivemind_ext.reducers).

Every tracker here (``SwarmProgressTracker``, the robust one included) also stops counting peers that are
gone. A peer's progress record stays in the DHT for ``--metadata-expiration`` seconds (60) after its last
report, so a trainer whose partner was killed, lost its link or was revoked kept counting it: it looked for a
group before every step and waited a whole round for nobody, about a minute of stalled steps. After a round
that found nobody the peer pings the others its tracker counts (``forget_gone_peers``); those that do not
answer are left out of the swarm's progress until their record changes (a peer that is back reports again),
so the steps after that one are taken alone at once.

A tracker can also be paced (``pace``, DiLoCo's): hivemind stores this peer's record at every
``report_local_progress``, that is at every inner step, and every store first reads every peer's record
(the DHT's search for the key's nearest nodes returns the values it passes). A round of DiLoCo does not
need a record per inner step: a paced tracker stores at most one per ``pace`` seconds (a new round or a
reset at once), and the others extrapolate between records with the rate each one carries. Reads keep
hivemind's pace, which quickens as the round's end nears: reading less often there made rounds end late
(14% more samples than their target at 4 peers; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any

import hivemind
import numpy as np
from hivemind.optim.progress_tracker import (
    GlobalTrainingProgress,
    LocalTrainingProgress,
    ProgressTracker,
    TrainingProgressSchema,
)
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from cotrain.access.voters import one_vote_each, voters_of
from cotrain.hivemind_ext.hooks import Tracker

logger = logging.getLogger(__name__)

PROGRESS_CAP = 2.0  # a peer's reported samples (and samples/s) count at most this many times the median's
WITNESSES = 2  # full peers that must report an epoch beyond this peer's next one for it to count
# seconds for the pings that tell a gone peer from a live one: a peer that ended refuses the dial at once; a
# live one on a busy machine may take seconds to answer (and is then not left out)
PING_TIMEOUT = 5.0
ROUND_RECORDS = 16  # progress records a paced peer stores per round, about (round_pace)


def robust_epoch(local_epoch: int, epochs: list[int]) -> int:
    """The swarm's epoch from the full peers' reported ``epochs``: the largest one that is at most
    ``local_epoch + 1`` or that at least WITNESSES peers reached."""
    best = local_epoch
    for epoch in sorted(set(epochs), reverse=True):
        if epoch <= local_epoch:
            break
        if epoch <= local_epoch + 1 or sum(e >= epoch for e in epochs) >= WITNESSES:
            best = epoch
            break
    return best


def witnessed_epoch(epochs: list[int], witnesses: int = WITNESSES) -> int | None:
    """The largest epoch that at least ``witnesses`` of the full peers' reported ``epochs`` reached (every
    one of them where fewer report: a newcomer beside a single peer takes its epoch); None when none
    report."""
    if not epochs:
        return None
    return sorted(epochs, reverse=True)[min(witnesses, len(epochs)) - 1]


def capped(values: list[float], cap: float = PROGRESS_CAP, among: list[float] | None = None) -> list[float]:
    """``values`` capped at ``cap`` times the median of ``among`` (default: of ``values``)."""
    reference = values if among is None else among
    if not values or not reference:
        return values
    limit = cap * float(np.median(reference))
    return [min(v, limit) for v in values]


class PacedSignal(threading.Event):
    """The signal that wakes a tracker's reporter, paced: a ``set`` within ``period`` seconds of the last one
    that took effect takes effect at the end of that period (one timer for all of them); ``now`` at once."""

    def __init__(self, period: float = 0.0) -> None:
        super().__init__()
        self.period = period
        self._last = -float("inf")
        self._timer: threading.Timer | None = None
        self._pace_lock = threading.Lock()

    def set(self) -> None:
        with self._pace_lock:
            wait = self._last + self.period - time.monotonic()
            if wait <= 0:
                self._set_locked()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._fire)
                self._timer.daemon = True
                self._timer.start()

    def now(self) -> None:
        with self._pace_lock:
            self._set_locked()

    def _fire(self) -> None:
        with self._pace_lock:
            self._timer = None
            if self.period >= 0:  # not stopped
                self._set_locked()

    def _set_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last = time.monotonic()
        super().set()


class SwarmProgressTracker(Tracker):
    """hivemind's ProgressTracker that leaves out the peers found gone (``leave_out``) until they report
    again, and can be paced (``pace``)."""

    follows_clients = False  # an auxiliary reducer's tracker: client-mode peers' epochs count too
    _clients = 0  # client-mode peers in the last read, for a tracker that follows them

    def __init__(self, *args: Any, follows_clients: bool = False, pace: float = 0.0, **kwargs: Any) -> None:
        """``follows_clients``: the tracker of an auxiliary reducer (cotrain.hivemind_ext.auxiliary), which
        serves client-mode peers: their epochs count toward the swarm's as full peers' do (hivemind counts
        full peers' only, and in a swarm of clients a reducer would stay at its own epoch). ``pace``: see the
        module's doc (0: hivemind's pace)."""
        self.follows_clients = follows_clients
        self._gone: dict[bytes, float] = {}  # peer id -> the time of its record when it was found gone
        self._gone_lock = threading.Lock()
        self._last_metadata: Any = None
        start = kwargs.pop("start", True)
        super().__init__(*args, start=False, **kwargs)
        self.signal_reports_with(PacedSignal())
        self.pace = pace
        if start:
            self.start()

    @property
    def pace(self) -> float:
        """Fewest seconds between this peer's progress records (see the module's doc)."""
        return self.should_report_progress.period

    @pace.setter
    def pace(self, seconds: float) -> None:
        self.should_report_progress.period = seconds

    def report_local_progress(
        self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True
    ) -> None:
        """hivemind's; a new epoch or fewer samples than reported (a reset) is stored at once, whatever the
        pace."""
        urgent = (
            local_epoch != self.local_progress.epoch
            or samples_accumulated < self.local_progress.samples_accumulated
        )
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        if urgent:
            self.should_report_progress.now()

    def shutdown(self, timeout: float | None = None) -> None:
        self.should_report_progress.period = -1.0  # unpaced: the reporter wakes at once and ends
        super().shutdown(timeout)

    def others(self, clients: bool = False) -> dict[bytes, float]:
        """The other peers the last read of the swarm's progress counted, those found gone left out: peer id
        -> its record's time. Full peers only unless ``clients`` (client-mode peers answer no pings: they are
        left to their record's expiration)."""
        entries = _entries(self._last_metadata, clients=clients)
        me = self.dht.peer_id.to_bytes()
        with self._gone_lock:
            return {peer: t for peer, t in entries.items() if peer != me and peer not in self._gone}

    def fetch_now(self) -> None:
        """Read the swarm's progress at once, not at the time hivemind planned from the previous round's."""
        self.global_progress.next_fetch_time = get_dht_time()
        self.global_state_updated.set()

    def other_epochs(self) -> list[int]:
        """The epochs of the other peers of the last read, client-mode peers too (hivemind's swarm epoch
        leaves them out), those found gone left out."""
        me, gone = self.dht.peer_id.to_bytes(), self._gone
        return [e for peer, e in _epochs(self._last_metadata).items() if peer != me and peer not in gone]

    def peers_past(self, epoch: int) -> list[bytes]:
        """The other full peers of the last read beyond ``epoch`` (those found gone left out): the peers that
        finished it, and can serve what it gave them (cotrain.hivemind_ext.roundresults)."""
        me, gone = self.dht.peer_id.to_bytes(), self._gone
        full = _entries(self._last_metadata, clients=False)
        epochs = _epochs(self._last_metadata)
        return [p for p, e in epochs.items() if e > epoch and p in full and p != me and p not in gone]

    def others_at(self) -> int | None:
        """The lowest of ``other_epochs``; None when there are none."""
        return min(self.other_epochs(), default=None)

    def ahead_of(self, epoch: int) -> int | None:
        """The round every other peer of the last read has gone to beyond ``epoch`` (``others_at``), where a
        peer behind may join them: the next round, or a later one that at least WITNESSES peers reached (one
        peer alone cannot move another further, as with the swarm's epoch: ``robust_epoch``); else None."""
        epochs = self.other_epochs()
        lowest = min(epochs, default=epoch)
        return lowest if lowest == epoch + 1 or (lowest > epoch and len(epochs) >= WITNESSES) else None

    def passed_by(self, epoch: int) -> bool:
        """Whether every other peer of the last read (``others_at``) is beyond ``epoch``, one at least: nobody
        is left to average ``epoch``'s round with."""
        lowest = self.others_at()
        return lowest is not None and lowest > epoch

    def leave_out(self, peers: dict[bytes, float]) -> None:
        """Stop counting ``peers`` (id -> the time of their record) until their record changes, and count the
        swarm's progress again now."""
        with self._gone_lock:
            self._gone.update(peers)
        if self._last_metadata is not None:  # one assignment, as the fetching thread makes (the caller may
            # hold the tracker's lock already: a global step pauses its updates)
            self.global_progress = self.parse_swarm_progress(self._last_metadata)

    def _live(self, metadata: Any) -> Any:
        """``metadata`` without the records of peers found gone whose record has not changed since; in a
        private swarm, one record per participant (cotrain.access.voters)."""

        if isinstance(metadata, dict):
            metadata = one_vote_each(metadata, voters_of(getattr(self, "dht", None)), newest=_record_time)
        self._last_metadata = metadata
        if self.follows_clients and isinstance(metadata, dict):
            metadata = self._clients_as_full_peers(metadata)
        if getattr(self, "_gone", None) is None:  # hivemind's __init__ reads the progress before ours runs
            return metadata
        entries = _entries(metadata)
        with self._gone_lock:
            for peer, seen in list(self._gone.items()):
                if entries.get(peer) != seen:  # it reported again, or its record expired
                    del self._gone[peer]
            if not self._gone:
                return metadata
            return {
                key: item
                for key, item in metadata.items()
                if _peer_of(item) is None or self._gone.get(_peer_of(item)) != entries.get(_peer_of(item))
            }

    def _clients_as_full_peers(self, metadata: dict) -> dict:
        """``metadata`` with client-mode peers' records read as full peers' (counted in ``_clients``)."""
        out, self._clients = {}, 0
        for key, item in metadata.items():
            value = getattr(item, "value", None)
            if isinstance(value, dict) and value.get("client_mode"):
                self._clients += 1
                item = ValueWithExpiration(dict(value, client_mode=False), item.expiration_time)
            out[key] = item
        return out

    def with_clients(self, progress: GlobalTrainingProgress) -> GlobalTrainingProgress:
        """``progress`` with the client-mode peers counted as such (a tracker that follows them)."""
        if self.follows_clients:
            progress.num_clients = self._clients
        return progress

    def parse_swarm_progress(self, metadata: TrainingProgressSchema) -> GlobalTrainingProgress:
        return self.with_clients(super().parse_swarm_progress(self._live(metadata)))


def _record_time(item: Any) -> float:
    value = getattr(item, "value", None)
    t = value.get("time") if isinstance(value, dict) else None
    return float(t) if isinstance(t, int | float) else 0.0


def _peer_of(item: Any) -> bytes | None:
    value = getattr(item, "value", None)
    peer = value.get("peer_id") if isinstance(value, dict) else None
    return peer if isinstance(peer, bytes) else None


def _entries(metadata: Any, clients: bool = True) -> dict[bytes, float]:
    """Peer id -> the time of its progress record, for the well-formed records of a read of the DHT (without
    client-mode peers' unless ``clients``)."""
    out: dict[bytes, float] = {}
    if isinstance(metadata, dict):
        for item in metadata.values():
            value, peer = getattr(item, "value", None), _peer_of(item)
            if peer is None or not isinstance(value.get("time"), int | float):
                continue
            if clients or not value.get("client_mode"):
                out[peer] = float(value["time"])
    return out


def _epochs(metadata: Any) -> dict[bytes, int]:
    """Peer id -> the epoch of its progress record, for the well-formed records of a read of the DHT."""
    out: dict[bytes, int] = {}
    if isinstance(metadata, dict):
        for item in metadata.values():
            value, peer = getattr(item, "value", None), _peer_of(item)
            if peer is not None and isinstance(value.get("epoch"), int):
                out[peer] = value["epoch"]
    return out


async def _ping(dht: hivemind.DHT, node: Any, peers: list[bytes], timeout: float) -> list[bytes]:
    """Run in the DHT's loop: the peers among ``peers`` that answer a DHT ping within ``timeout``."""
    calls = [asyncio.wait_for(node.protocol.call_ping(PeerID(p)), timeout) for p in peers]
    answers = await asyncio.gather(*calls, return_exceptions=True)
    return [
        p for p, a in zip(peers, answers, strict=True) if a is not None and not isinstance(a, BaseException)
    ]


def forget_gone_peers(tracker: ProgressTracker, dht: hivemind.DHT, timeout: float = PING_TIMEOUT) -> int:
    """Ping the other full peers ``tracker`` counts and leave out those that do not answer. Returns how many
    were left out (0 with a tracker that cannot leave peers out). Called after a round that found nobody."""
    if not isinstance(tracker, SwarmProgressTracker):
        return 0
    others = tracker.others()
    if not others:
        return 0
    try:
        answered = set(dht.run_coroutine(functools.partial(_ping, peers=list(others), timeout=timeout)))
    except Exception as e:  # the DHT is stopping: nothing to conclude
        logger.debug(f"pinging the swarm's peers failed: {e!r}")
        return 0
    gone = {p: t for p, t in others.items() if p not in answered}
    if gone:
        tracker.leave_out(gone)
        logger.info(
            f"{len(gone)} of the {len(others)} other peers in the swarm's progress do not answer: training "
            "without them until they report again"
        )
    return len(gone)


class RobustProgressTracker(SwarmProgressTracker):
    """hivemind's ProgressTracker counting the swarm's progress as the module's doc says."""

    def parse_swarm_progress(self, metadata: TrainingProgressSchema) -> GlobalTrainingProgress:
        metadata = self._live(metadata)
        if not isinstance(metadata, dict) or len(metadata) == 0:
            return self.with_clients(Tracker.parse_swarm_progress(self, metadata))
        current_time = get_dht_time()
        entries = [
            LocalTrainingProgress.parse_obj(peer_state.value)
            for peer_state in metadata.values()
            if peer_state.value is not None
        ]
        num_peers = len(entries)
        num_clients = sum(peer.client_mode for peer in entries)
        global_epoch = robust_epoch(
            self.local_progress.epoch, [peer.epoch for peer in entries if not peer.client_mode]
        )
        current = [peer for peer in entries if peer.epoch == global_epoch]
        # the median is over every peer, those not at the epoch counting 0 for it: while one honest peer of
        # three is still at the previous epoch, the median of the other two alone would be half a liar's claim
        samples = capped(
            [float(peer.samples_accumulated) for peer in current],
            among=[float(p.samples_accumulated) if p.epoch == global_epoch else 0.0 for p in entries],
        )
        rates = capped([float(peer.samples_per_second) for peer in entries])
        rate_of = {id(peer): rate for peer, rate in zip(entries, rates, strict=True)}
        total_samples = int(sum(samples))
        estimated = sum(
            s + max(0.0, current_time - peer.time) * rate_of[id(peer)]
            for peer, s in zip(current, samples, strict=True)
        )
        total_rate = self.performance_ema.eps + sum(rates)
        eta = max(0.0, self.target_batch_size - estimated) / total_rate
        drift = max(num_peers + self.expected_drift_peers, num_peers * (1 + self.expected_drift_rate))
        next_fetch = float(np.clip(eta * num_peers / drift, self.min_refresh_period, self.max_refresh_period))
        logger.log(
            self.status_loglevel,
            f"{self.prefix} accumulated {total_samples} samples (capped) for epoch #{global_epoch} from "
            f"{num_peers} peers. ETA {eta:.2f} sec (refresh in {next_fetch:.2f} sec)",
        )
        progress = GlobalTrainingProgress(
            global_epoch,
            total_samples,
            target_batch_size=self.target_batch_size,
            num_peers=num_peers,
            num_clients=num_clients,
            eta_next_epoch=current_time + eta,
            next_fetch_time=current_time + next_fetch,
        )
        return self.with_clients(progress)


def round_pace(matchmaking_time: float, round_seconds: float = 0.0, expiration: float = 60.0) -> float:
    """The pace (see the module's doc) of a tracker of rounds that last about ``round_seconds``: a
    ROUND_RECORDS-th of a round, at least the matchmaking time and at most a quarter of the records'
    ``expiration``."""
    return min(max(matchmaking_time, round_seconds / ROUND_RECORDS), expiration / 4)


def tracker_class(robust: bool) -> type[ProgressTracker]:
    return RobustProgressTracker if robust else SwarmProgressTracker
