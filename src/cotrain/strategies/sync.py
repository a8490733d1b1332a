"""``sync``, the seed recipe: large-batch synchronous SGD. ``hivemind.Optimizer`` (cotrain's
``SwarmOptimizer``) accumulates the swarm's samples until ``target_batch_size``, averages gradients in groups,
and every peer takes the same optimizer step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from hivemind.compression import NoCompression

from cotrain.config import PeerConfig, RunConfig
from cotrain.hivemind_ext.auxiliary import GradientReducer
from cotrain.hivemind_ext.averaging import gradient_averager_factory
from cotrain.hivemind_ext.liveness import cancel_controls
from cotrain.hivemind_ext.optimizer import (
    LOAD_STATE_COMPRESSION,
    SwarmOptimizer,
    request_timeout,
    state_compression,
    tracker_options,
)
from cotrain.hivemind_ext.statecheck import CheckedTrainingStateAverager
from cotrain.keys import progress_key, state_averager_prefix
from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
from cotrain.strategies.base import HivemindStrategy
from cotrain.strategies.builds import aggregation_of, averager_options, grad_compression_of, tracker_settings

__all__ = ["SyncStrategy", "sync_optimizer"]

logger = logging.getLogger(__name__)


class SyncStrategy(HivemindStrategy):
    """Synchronous large-batch training with ``hivemind.Optimizer`` (cotrain's ``SwarmOptimizer``)."""

    name = "sync"

    def __init__(
        self,
        dht: Any,
        run: RunConfig,
        peer: PeerConfig,
        params: Iterable,
        optimizer: Callable,
        scheduler: Callable | None,
        batch_size_per_step: int | None,
        should_stop: Callable[[], bool],
    ) -> None:
        self.run_id = run.run_id
        self.opt = sync_optimizer(dht, run, peer, params, optimizer, scheduler, batch_size_per_step)
        self.opt.should_stop = should_stop
        self.load_state_timeout = peer.load_state_timeout

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.opt.state_averager.optimizer

    def cancel_rounds(self) -> None:
        """Cancel pending averaging rounds, so a blocked step returns and shutdown proceeds in order."""
        cancel_controls(self.opt.scheduled_grads, self.opt.scheduled_state)

    @contextlib.contextmanager
    def training_state(self) -> Iterator[tuple[torch.optim.Optimizer, Any, list[torch.Tensor]]]:
        """(optimizer, scheduler, parameters) of the state the swarm averages, locked while in use: what a
        checkpoint saves and a resume loads into."""
        averager = self.opt.state_averager
        with averager.lock_averaged_tensors:
            yield averager.optimizer, averager.scheduler, averager.main_parameters

    def resumed_at(self, step: int) -> None:
        averager = self.opt.state_averager
        averager.local_epoch = int(step)
        self.state_replaced()
        if not self.client_mode:
            averager.state_sharing_priority = self.opt.local_epoch

    @staticmethod
    def state_holder(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
        """The monitor's and evaluation peer's copy of the swarm's state: a hivemind TrainingStateAverager
        with the trainers' prefix, optimizer and schedule, in full precision, not serving until it holds a
        state; it publishes its fingerprint and checks what it downloads (cotrain.hivemind_ext.statecheck)."""

        return CheckedTrainingStateAverager(
            dht=dht,
            prefix=state_averager_prefix(run.run_id),
            progress_key=progress_key(run.run_id) if aggregation_of(run).robust else None,
            optimizer=optimizer_factory(run),
            params=parameter_groups(model, run.weight_decay),
            scheduler=scheduler_factory(run),
            state_compression=NoCompression(),  # full precision: optimizer moments must not be flushed
            # it never averages: hivemind's copy of the parameters for all-reduce rounds would be memory
            # unused (the model's size); a model on a GPU (an evaluation peer's) cannot be shared this way
            reuse_tensors=all(p.device.type == "cpu" for p in model.parameters()),
            min_matchmaking_time=peer.matchmaking_time,
            request_timeout=request_timeout(peer.matchmaking_time),
            allow_state_sharing=False,  # until there is a state worth serving
            keeps_state=True,  # it answers downloads only (the monitor's reducer answers its all-reduces)
            status_loglevel=logging.INFO if peer.verbose else logging.DEBUG,
            start=True,
        )

    @staticmethod
    def reducer(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
        """An auxiliary SwarmOptimizer over ``model``'s parameters (it reduces the gradient and state rounds'
        parts; cotrain.hivemind_ext.auxiliary.GradientReducer)."""
        params = parameter_groups(model, run.weight_decay)
        opt = sync_optimizer(
            dht, run, peer, params, optimizer_factory(run), scheduler_factory(run), None, auxiliary=True
        )
        return GradientReducer(opt)


def sync_optimizer(
    dht: Any,
    run: RunConfig,
    peer: PeerConfig,
    params: Iterable,
    optimizer: Callable,
    scheduler: Callable | None,
    batch_size_per_step: int | None,
    auxiliary: bool = False,
) -> Any:
    """The sync strategy's SwarmOptimizer for these settings (``auxiliary``: an auxiliary reducer's, which
    accumulates nothing and steps nothing)."""
    averager_opts = averager_options(peer)
    run_id, target_batch_size = run.run_id, run.target_batch_size
    return SwarmOptimizer(
        dht=dht,
        # hivemind keeps client_mode=None (read as "not a client") unless a value is given, and then uses
        # the DHT's: a client would try to serve its state and fail at its first global step
        client_mode=dht.client_mode,
        auxiliary=auxiliary,
        run_id=run_id,
        params=list(params),
        optimizer=optimizer,
        scheduler=scheduler,
        target_batch_size=max(1, target_batch_size - peer.batch_size_lead),
        batch_size_per_step=batch_size_per_step,
        matchmaking_time=peer.matchmaking_time,
        averaging_timeout=peer.averaging_timeout,
        load_state_timeout=peer.load_state_timeout,
        grad_compression=grad_compression_of(peer),
        state_averaging_compression=state_compression(peer.grad_compression),
        load_state_compression=LOAD_STATE_COMPRESSION,
        average_state_every=1,
        offload_optimizer=peer.offload_optimizer,
        delay_optimizer_step=peer.delay_optimizer_step or peer.delay_grad_averaging,
        delay_grad_averaging=peer.delay_grad_averaging,
        delay_state_averaging=peer.delay_state_averaging,
        averager_opts=averager_opts,
        # hivemind gives averager_opts to the state averager only; the gradient averager gets them here
        grad_averager_factory=gradient_averager_factory(dict(averager_opts, aggregation=aggregation_of(run))),
        robust_progress=aggregation_of(run).robust,
        tracker_opts=tracker_options(peer.matchmaking_time, tracker_settings(peer)),
        performance_ema_alpha=peer.performance_ema_alpha,
        verbose=peer.verbose,
    )
