"""The collaborative optimizer: hivemind.Optimizer configured from a RunConfig, reporting its group sizes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import hivemind
import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, RoleAdaptiveCompression

from cotrain.config import PeerConfig, RunConfig
from cotrain.swarm import fixes
from cotrain.swarm.averaging import gradient_averager_factory

logger = logging.getLogger(__name__)


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that remembers how many peers its last gradient-averaging round had."""

    last_group_size: int = 1
    rounds_averaged: int = 0
    rounds_failed: int = 0

    def __init__(self, **kwargs) -> None:
        fixes.apply()
        super().__init__(**kwargs)
        # hivemind runs the optimizer step in a helper thread, where torch would start a second OpenMP team.
        # With more OpenMP threads than cores, libgomp stops spin-waiting in every team, so each barrier of
        # the training thread's forward/backward becomes a sleep and a wake-up (~1,500/s, 0.8x the samples/s
        # on 2 cores). So torch ops run single-threaded in that thread (the optimizer step is ~1% of the
        # time), and in any other helper thread that starts using torch later (set_num_threads also changes
        # torch's default); the training thread, which builds this optimizer, keeps its count: read it first.
        torch.get_num_threads()
        self.state_averager.step_executor.submit(torch.set_num_threads, 1).result()

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        super()._average_gradients_and_load_into_optimizer(maybe_step_control)
        size = 1
        if maybe_step_control is not None:
            try:
                if maybe_step_control.done() and maybe_step_control.exception() is None:
                    size = len(maybe_step_control.result())
                    self.rounds_averaged += 1
                else:
                    self.rounds_failed += 1
            except BaseException:  # cancelled or failed round: the peer used its local gradients
                self.rounds_failed += 1
        self.last_group_size = max(1, size)

    def _maybe_schedule_gradient_averaging(self) -> None:
        """Pre-schedule a gradient-averaging round only while the tracker sees other peers. Alone, hivemind
        would still run matchmaking before every global step (its averager polling the DHT in a tight loop,
        about 0.7 of a core with the DHT process) for a round it then cancels: there is nobody to average
        with. With other peers this is hivemind's own method, unchanged."""
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def load_state_from_peers(self, **kwargs) -> None:
        """hivemind retries forever when no peer can serve state; this gives up after load_state_timeout."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        load_state_bounded(self, self.load_state_timeout, self.should_stop)

    def should_stop(self) -> bool:
        return False


def build_optimizer(
    dht: hivemind.DHT,
    run: RunConfig,
    peer: PeerConfig,
    params: list[dict],
    optimizer_factory: Callable,
    scheduler_factory: Callable,
    batch_size_per_step: int,
) -> SwarmOptimizer:
    averager_opts: dict = {
        "target_group_size": peer.target_group_size,
        "request_timeout": request_timeout(run.matchmaking_time),
    }
    if peer.bandwidth > 0:
        averager_opts["bandwidth"] = peer.bandwidth
    return SwarmOptimizer(
        dht=dht,
        # hivemind keeps client_mode=None (read as "not a client") unless a value is given, and then uses the
        # DHT's: a client would try to serve its state and fail at its first global step
        client_mode=dht.client_mode,
        run_id=run.run_id,
        params=params,
        optimizer=optimizer_factory,
        scheduler=scheduler_factory,
        target_batch_size=max(1, run.target_batch_size - peer.batch_size_lead),
        batch_size_per_step=batch_size_per_step,
        matchmaking_time=run.matchmaking_time,
        averaging_timeout=run.averaging_timeout,
        load_state_timeout=peer.load_state_timeout,
        grad_compression=gradient_compression(run),
        state_averaging_compression=state_compression(run),
        load_state_compression=LOAD_STATE_COMPRESSION,
        average_state_every=1,
        offload_optimizer=peer.offload_optimizer,
        delay_optimizer_step=peer.delay_optimizer_step or peer.delay_grad_averaging,
        delay_grad_averaging=peer.delay_grad_averaging,
        delay_state_averaging=peer.delay_state_averaging,
        averager_opts=averager_opts,
        # hivemind gives averager_opts to the state averager only; the gradient averager gets them here
        grad_averager_factory=gradient_averager_factory(averager_opts),
        tracker_opts=tracker_options(run, peer),
        performance_ema_alpha=peer.performance_ema_alpha,
        verbose=peer.verbose,
    )


# A newcomer downloads parameters and optimizer statistics in full precision: fp16 would flush LAMB/Adam
# second moments (often below 1e-8) to zero and change the parameters it starts from.
LOAD_STATE_COMPRESSION = NoCompression()


def build_model_optimizer(
    dht: hivemind.DHT, run: RunConfig, peer: PeerConfig, model: torch.nn.Module, batch_size_per_step: int
) -> SwarmOptimizer:
    """A trainer's optimizer for ``model``: the run's optimizer and schedule by name, no weight decay on
    biases and LayerNorm weights."""
    from cotrain.models import optimizer_factory, parameter_groups, scheduler_factory

    groups = parameter_groups(model, run.weight_decay)
    return build_optimizer(
        dht, run, peer, groups, optimizer_factory(run), scheduler_factory(run), batch_size_per_step
    )


def gradient_compression(run: RunConfig) -> CompressionBase:
    """Gradients averaged in fp16 with --grad-compression fp16 (the default)."""
    return Float16Compression() if run.grad_compression == "fp16" else NoCompression()


def state_compression(run: RunConfig) -> CompressionBase:
    """State averaging: parameters in fp16 with --grad-compression fp16; tensors tagged as optimizer
    statistics (LAMB/Adam moments, when averaged) and anything untagged stay in full precision."""
    if run.grad_compression != "fp16":
        return NoCompression()
    return RoleAdaptiveCompression(
        parameter=Float16Compression(), optimizer=NoCompression(), default=NoCompression()
    )


def tracker_options(run: RunConfig, peer: PeerConfig) -> dict:
    """hivemind ProgressTracker's tuning from the peer's options."""
    max_refresh = peer.max_refresh_period or max(1.0, run.matchmaking_time * 2)
    return {
        "min_refresh_period": min(peer.min_refresh_period, max_refresh),
        "max_refresh_period": max_refresh,
        "default_refresh_period": peer.default_refresh_period,
        "expected_drift_peers": peer.expected_drift_peers,
        "expected_drift_rate": peer.expected_drift_rate,
        "metadata_expiration": peer.metadata_expiration,
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
                opt.state_averager.load_state_from_peers(timeout=min(remaining, opt.load_state_timeout))
                if opt.grad_averager is not None:
                    opt.grad_averager.load_state_from_peers(timeout=min(remaining, opt.load_state_timeout))
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
