"""The collaborative optimizer: hivemind.Optimizer configured from a RunConfig, reporting its group sizes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import hivemind
import torch
from hivemind.compression import Float16Compression, NoCompression

from cotrain.config import PeerConfig, RunConfig

logger = logging.getLogger(__name__)


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer that remembers how many peers its last gradient-averaging round had."""

    last_group_size: int = 1
    rounds_averaged: int = 0
    rounds_failed: int = 0

    def __init__(self, **kwargs) -> None:
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
    compression = Float16Compression() if run.grad_compression == "fp16" else NoCompression()
    averager_opts: dict = {}
    if peer.bandwidth > 0:
        averager_opts["bandwidth"] = peer.bandwidth
    return SwarmOptimizer(
        dht=dht,
        run_id=run.run_id,
        params=params,
        optimizer=optimizer_factory,
        scheduler=scheduler_factory,
        target_batch_size=max(1, run.target_batch_size - peer.batch_size_lead),
        batch_size_per_step=batch_size_per_step,
        matchmaking_time=run.matchmaking_time,
        averaging_timeout=run.averaging_timeout,
        load_state_timeout=peer.load_state_timeout,
        grad_compression=compression,
        state_averaging_compression=compression,
        # optimizer statistics (LAMB/Adam moments) travel uncompressed: fp16 flushes small moments to zero
        load_state_compression=NoCompression(),
        average_state_every=1,
        averager_opts=averager_opts,
        tracker_opts={"min_refresh_period": 0.5, "max_refresh_period": max(1.0, run.matchmaking_time * 2)},
        verbose=peer.verbose,
    )


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
