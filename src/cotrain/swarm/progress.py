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
  (``witnessed_epoch``, applied by cotrain.swarm.statecheck) while a donor within it serves: otherwise a
  newcomer or a lagging peer would take a lone liar's epoch and become its second witness.

The all-reduce's weights are capped at their median by the reducers (cotrain.swarm.robust).
"""

from __future__ import annotations

import logging

import numpy as np
from hivemind.optim.progress_tracker import (
    GlobalTrainingProgress,
    LocalTrainingProgress,
    ProgressTracker,
    TrainingProgressSchema,
)
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

PROGRESS_CAP = 2.0  # a peer's reported samples (and samples/s) count at most this many times the median's
WITNESSES = 2  # full peers that must report an epoch beyond this peer's next one for it to count


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


class RobustProgressTracker(ProgressTracker):
    """hivemind's ProgressTracker counting the swarm's progress as the module's doc says."""

    def _parse_swarm_progress_data(self, metadata: TrainingProgressSchema) -> GlobalTrainingProgress:
        if not isinstance(metadata, dict) or len(metadata) == 0:
            return super()._parse_swarm_progress_data(metadata)
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
        return GlobalTrainingProgress(
            global_epoch,
            total_samples,
            target_batch_size=self.target_batch_size,
            num_peers=num_peers,
            num_clients=num_clients,
            eta_next_epoch=current_time + eta,
            next_fetch_time=current_time + next_fetch,
        )


def tracker_class(robust: bool) -> type[ProgressTracker]:
    return RobustProgressTracker if robust else ProgressTracker
