"""The collaborative optimizer: hivemind.Optimizer with bounded state downloads, reporting its group sizes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    RoleAdaptiveCompression,
)

from cotrain import hivemind_ext as internals
from cotrain.hivemind_ext.auxiliary import contributors
from cotrain.hivemind_ext.hooks import Optimizer
from cotrain.hivemind_ext.liveness import RoundWatch, WatchedRounds
from cotrain.hivemind_ext.progress import PING_TIMEOUT, forget_gone_peers, tracker_class
from cotrain.hivemind_ext.statecheck import CheckedTrainingStateAverager
from cotrain.keys import progress_key, state_averager_prefix
from cotrain.registry import codec

logger = logging.getLogger(__name__)

GROUPED = (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE)  # a round that found its group


class SwarmOptimizer(Optimizer):
    """hivemind.Optimizer that remembers how many peers its last gradient-averaging round had."""

    last_group_size: int = 1
    rounds_averaged: int = 0
    rounds_failed: int = 0
    _reloaded_behind: tuple[int, int] | None = None  # (own, swarm's) steps of the last download for a step

    def __init__(self, *, robust_progress: bool = False, **kwargs) -> None:
        internals.install()
        self.robust_progress = robust_progress  # read by make_progress_tracker, within hivemind's __init__
        super().__init__(**kwargs)
        # hivemind runs the optimizer step in a helper thread, where torch would start a second OpenMP team.
        # With more OpenMP threads than cores, libgomp stops spin-waiting in every team, so each barrier of
        # the training thread's forward/backward becomes a sleep and a wake-up (~1,500/s, 0.8x the samples/s
        # on 2 cores). So torch ops run single-threaded in that thread (the optimizer step is ~1% of the
        # time), and in any other helper thread that starts using torch later (set_num_threads also changes
        # torch's default); the training thread, which builds this optimizer, keeps its count: read it first.
        torch.get_num_threads()
        self.state_averager.step_executor.submit(torch.set_num_threads, 1).result()
        # a round looking for a group while no other peer answers stops within a matchmaking time
        self.round_watch = RoundWatch(
            [a for a in (self.grad_averager, self.state_averager) if isinstance(a, WatchedRounds)],
            self.tracker,
            self.dht,
            self.matchmaking_time,
            lambda: self.should_stop(),
        )
        self.round_watch.start()

    def shutdown(self) -> None:
        watch = getattr(self, "round_watch", None)
        if watch is not None:
            watch.close()
        super().shutdown()

    def make_progress_tracker(self, target_batch_size: int, **kwargs):
        """hivemind's tracker, or with ``robust_progress`` the one that caps what peers claim
        (cotrain.hivemind_ext.progress)."""

        return tracker_class(self.robust_progress)(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            follows_clients=self.auxiliary,
            start=True,
            **kwargs,
        )

    def make_state_averager(self, **kwargs):
        """hivemind's state averager (with the arguments hivemind.Optimizer gives it), its downloads checked
        against the fingerprints that peers publish of their state (cotrain.hivemind_ext.statecheck)."""

        return CheckedTrainingStateAverager(
            dht=self.dht,
            prefix=state_averager_prefix(self.run_id),
            progress_key=progress_key(self.run_id) if self.robust_progress else None,
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def average_gradients(self, maybe_step_control) -> None:
        super().average_gradients(maybe_step_control)
        size = 1
        if maybe_step_control is not None:
            try:
                if maybe_step_control.done() and maybe_step_control.exception() is None:
                    size = contributors(maybe_step_control.result())
                    self.rounds_averaged += 1
                else:
                    self.rounds_failed += 1
            except BaseException:  # cancelled or failed round: the peer used its local gradients
                self.rounds_failed += 1
            if size <= 1 and not self.should_stop():  # nobody averaged with it: are the others still there?
                forget_gone_peers(self.tracker, self.dht, PING_TIMEOUT)
        self.last_group_size = max(1, size)

    def maybe_schedule_gradient_averaging(self) -> None:
        """Pre-schedule a gradient-averaging round only while the tracker sees other peers. Alone, hivemind
        would still run matchmaking before every global step (its averager polling the DHT in a tight loop,
        about 0.7 of a core with the DHT process) for a round it then cancels: there is nobody to average
        with. With other peers this is hivemind's own method, unchanged."""
        if self.tracker.global_progress.num_peers > 1:
            super().maybe_schedule_gradient_averaging()

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind retries forever when no peer can serve state; this gives up after load_state_timeout."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self.tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        load_state_bounded(self, self.load_state_timeout, self.should_stop)

    def update_global_epoch(self, grad_scaler) -> None:
        """hivemind's global step, except for a peer the swarm left behind with a gradient of a few samples:
        it loads the swarm's state instead of stepping alone on them (see left_behind)."""
        if self.left_behind():
            own, swarm = self.local_epoch, self.tracker.global_epoch
            samples = self.grad_averager.local_samples_accumulated
            logger.info(
                f"The swarm is at step {swarm} and no group takes this peer's gradient for step {own} "
                f"({samples} samples): loading the swarm's state instead of stepping alone",
            )
            self._reloaded_behind = (own, swarm)  # a failed download: the next call steps as hivemind does
            self.load_state_from_peers()
            return
        self.last_group_size = 1  # a step without a round averaged with nobody (a round sets its own size)
        super().update_global_epoch(grad_scaler)

    def left_behind(self) -> bool:
        """The swarm stepped past this peer's step without it, and this peer holds fewer samples than its
        share of a step (target / peers): a newcomer that loaded a state the swarm then left, or a peer that
        missed a round. hivemind would take an optimizer step on those few samples alone (one noisy step at
        the full learning rate, which the next parameter average spreads over the swarm); a download costs
        the download and those samples. A peer in a group that will average its gradient, one with at least
        its share of samples, or one that already tried a download at these two steps steps as hivemind
        does."""
        if self.auxiliary or not self.use_gradient_averaging:
            return False
        own, swarm = self.local_epoch, self.tracker.global_epoch
        peers = self.tracker.global_progress.num_peers
        if own >= swarm or peers <= 1 or self._reloaded_behind == (own, swarm):
            return False
        control = self.scheduled_grads
        if control is not None and not control.done() and control.stage in GROUPED:
            return False
        return self.grad_averager.local_samples_accumulated * peers < self.target_batch_size

    def should_stop(self) -> bool:
        return False


# A newcomer downloads parameters and optimizer statistics in full precision: fp16 would flush LAMB/Adam
# second moments (often below 1e-8) to zero and change the parameters it starts from.
LOAD_STATE_COMPRESSION = NoCompression()


def gradient_compression(name: str, options: dict | None = None) -> CompressionBase:
    """What --grad-compression sends gradients (diloco: pseudo-gradients) as: the hivemind compression that
    the dense codec ``name`` of cotrain.registry builds with its ``options`` (fp16, the default; 8bit,
    hivemind's uniform 8-bit quantization; none)."""
    dense = codec(name)
    if dense.kind != "dense":
        raise ValueError(f"grad_compression {name!r} is a {dense.kind} codec, not a dense one")
    return dense.build(**dense.settings(options or {}, what=f"grad_compression {name}"))


def state_compression(name: str) -> CompressionBase:
    """State averaging: parameters in fp16 with a lossy --grad-compression (fp16, 8bit); tensors tagged as
    optimizer statistics (LAMB/Adam moments, when averaged) and anything untagged stay in full precision;
    everything in full precision with a lossless one (none)."""
    if codec(name).lossless:
        return NoCompression()
    return RoleAdaptiveCompression(
        parameter=Float16Compression(), optimizer=NoCompression(), default=NoCompression()
    )


def tracker_options(matchmaking_time: float, settings: dict) -> dict:
    """hivemind ProgressTracker's tuning from the peer's settings (min/max/default refresh periods, expected
    drift, metadata expiration); a max refresh period of 0 means twice the matchmaking time, at least 1 s."""
    max_refresh = settings["max_refresh_period"] or max(1.0, matchmaking_time * 2)
    return {
        **settings,
        "min_refresh_period": min(settings["min_refresh_period"], max_refresh),
        "max_refresh_period": max_refresh,
    }


def request_timeout(matchmaking_time: float) -> float:
    """How long to wait for a group leader's answer: hivemind's 3 s, but below the matchmaking time, as
    its matchmaking needs to break waiting cycles between would-be leaders within that time."""
    return min(3.0, 0.5 * matchmaking_time)


def parameters_finite(model: torch.nn.Module) -> bool:
    return all(torch.isfinite(p).all().item() for p in model.parameters())


def load_state_bounded(opt: hivemind.Optimizer, timeout: float, should_stop: Callable[[], bool]) -> bool:
    """Download the swarm's current state, giving up after ``timeout`` seconds instead of retrying forever.

    Returns True if a newer state was loaded (the peer's local epoch moved forward).
    """
    import time

    deadline = time.monotonic() + timeout
    epoch_before = opt.local_epoch
    with opt.tracker.pause_updates():
        while not should_stop():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning(
                    f"Could not load the swarm's state within {timeout:.0f} s; continuing from local state"
                )
                return False
            try:
                # hivemind also downloads its gradient averager's "state" here: another peer's gradient
                # accumulators, reset below; cotrain's gradient averagers serve none (SwarmGradientAverager)
                opt.state_averager.load_state_from_peers(timeout=min(remaining, opt.load_state_timeout))
                break
            except Exception as e:
                logger.info(f"Loading state from peers failed ({e!r}); retrying for {remaining:.0f} more s")
        if opt.tracker.global_epoch - 1 <= opt.local_epoch < opt.tracker.global_epoch:
            opt.state_averager.local_epoch = opt.tracker.global_epoch
        opt.tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)
        if not opt.client_mode:
            opt.state_averager.state_sharing_priority = opt.local_epoch
        if opt.use_gradient_averaging:
            opt.grad_averager.reset_accumulated_grads_()
            if not opt.client_mode:
                opt.grad_averager.state_sharing_priority = opt.local_epoch
    return opt.local_epoch > epoch_before
