"""Training strategies: how a peer's local gradients become the swarm's steps.

A strategy owns the swarm-facing optimizer and the training state it averages; the engine (SwarmPeer) calls
it and never reaches into hivemind itself. ``sync`` is the seed recipe's large-batch synchronous SGD:
``hivemind.Optimizer`` accumulates the swarm's samples until ``target_batch_size``, averages gradients in
groups, and every peer takes the same optimizer step. ``diloco`` (cotrain.swarm.diloco) takes ``local_steps``
steps of the inner optimizer alone, then averages the parameters' change over the round and takes one outer
Nesterov step. A strategy is a subclass of ``Strategy``, registered in ``cotrain.registry.STRATEGIES``; its
``state_holder`` builds the averager through which the monitor and the evaluation peer download, keep and
serve the swarm's state.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from cotrain.config import PeerConfig, RunConfig
from cotrain.engine.builds import (
    aggregation_of,
    averager_options,
    diloco_reducer,
    sync_optimizer,
    tracker_settings,
)
from cotrain.errors import UserError
from cotrain.swarm.internals.hooks import load_local_tensors

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointParts:
    """What a checkpoint saves and a resume loads into: the model holds the parameters to save (the swarm's
    global ones), ``optimizer`` and ``scheduler`` the swarm's optimizer, ``params`` the model's parameters in
    the optimizer's order (when it holds copies), ``inner`` DiLoCo's inner (optimizer, scheduler)."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    params: list[torch.Tensor]
    inner: tuple[torch.optim.Optimizer, Any] | None = None


class Strategy(abc.ABC):
    """A training strategy, as the engine (``SwarmPeer``), the healer and the NaN guard see it: its progress,
    a step, the state it trains and serves, and its end. Nothing here names hivemind: a strategy built on
    other machinery implements the same methods. A new one is a subclass in a module of its own and a line in
    ``cotrain.registry.STRATEGIES`` (or ``register_strategy``).

    Its constructor takes ``(dht, run, peer, params, optimizer, scheduler, batch_size_per_step,
    should_stop)``: the swarm's DHT, the run's and the peer's settings (cotrain.config), the parameters (or
    groups) to train, a function params -> torch optimizer, an optional function optimizer -> LR scheduler,
    the default samples per ``step`` and a function that says when the peer is stopping."""

    name: ClassVar[str] = ""
    # whether ``training_state()`` only ever moves by steps checked finite, so that the NaN guard restores
    # from it (``restore_from_state``) instead of keeping a copy of it (cotrain.swarm.backup)
    state_is_backup: ClassVar[bool] = False

    # --- progress ------------------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def global_step(self) -> int:
        """The swarm's global step this peer is at (diloco: outer rounds)."""

    @property
    @abc.abstractmethod
    def swarm_step(self) -> int:
        """The swarm's global step as this peer last saw it."""

    @property
    @abc.abstractmethod
    def swarm_samples(self) -> int:
        """Samples the swarm has accumulated toward its next global step, as last seen."""

    @property
    @abc.abstractmethod
    def num_peers(self) -> int:
        """Peers training in the run, this one included, as last seen."""

    @property
    @abc.abstractmethod
    def last_group_size(self) -> int:
        """Peers in this peer's last averaging group, itself included (1: it stepped alone)."""

    @property
    @abc.abstractmethod
    def rounds(self) -> tuple[int, int]:
        """Averaging rounds that succeeded and that failed so far."""

    @property
    @abc.abstractmethod
    def samples_per_second(self) -> float:
        """This peer's training throughput, as it reports it to the swarm."""

    @property
    @abc.abstractmethod
    def batch_size_per_step(self) -> int | None:
        """Samples behind one ``step`` when the caller gives none."""

    @property
    @abc.abstractmethod
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps the model's parameters."""

    @property
    @abc.abstractmethod
    def client_mode(self) -> bool:
        """Whether this peer only sends (it serves nothing, neither its state nor all-reduce parts)."""

    @property
    def inner_steps(self) -> int:
        """Inner optimizer steps (diloco; 0 where there are none)."""
        return 0

    @property
    def round_bytes(self) -> int:
        """Payload this peer sent in its last round (diloco; 0 where it is not measured)."""
        return 0

    @property
    def inner(self) -> tuple[torch.optim.Optimizer, Any] | None:
        """An inner (optimizer, scheduler) that a checkpoint also holds (diloco; None otherwise)."""
        return None

    # --- a step --------------------------------------------------------------------------------------

    @abc.abstractmethod
    def step(self, samples: int) -> None:
        """The gradients in the parameters' ``.grad`` come from ``samples`` samples: take them into the
        swarm's training (accumulate, average, step when the swarm has enough)."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    # --- the state it trains and serves ----------------------------------------------------------------

    @abc.abstractmethod
    def training_state(self) -> contextlib.AbstractContextManager:
        """(optimizer, scheduler, parameters) of the state the swarm averages, locked while in use: what a
        checkpoint saves, a resume and the NaN guard load into (the parameters in the optimizer's order)."""

    @contextlib.contextmanager
    def checkpoint_state(self) -> Iterator[CheckpointParts]:
        """What a checkpoint saves (by default: ``training_state()``)."""
        with self.training_state() as (optimizer, scheduler, params):
            yield CheckpointParts(optimizer, scheduler, params)

    @abc.abstractmethod
    def state_replaced(self) -> None:
        """``training_state()`` was written from outside (a checkpoint, the NaN guard's backup): the
        copies the strategy keeps follow it, gradients accumulated since are dropped, its progress is
        reported anew."""

    @abc.abstractmethod
    def resumed_at(self, step: int) -> None:
        """After a checkpoint was loaded into ``training_state()``: continue from its global step."""

    def restore_from_state(self) -> bool:
        """Where ``state_is_backup``: train on from ``training_state()`` (its parameters into the model).
        Returns False where that state is not finite either."""
        raise NotImplementedError(f"strategy {self.name!r} keeps no state to restore from")

    def model_parameters(self) -> list[torch.Tensor]:
        """Where ``state_is_backup``: the model's parameters, all the NaN guard checks (read without the
        state's lock, which a round may hold)."""
        raise NotImplementedError(f"strategy {self.name!r} keeps no state to restore from")

    def attach_node(self, node: Any) -> None:
        """Train as a peer of several ranks (cotrain.engine.node.Node, on rank 0): the state this strategy
        holds is gathered from the ranks and sent back to them where the swarm's rounds need it."""
        raise UserError(f"strategy {self.name!r} trains on one rank; a peer of several ranks trains DiLoCo")

    @abc.abstractmethod
    def load_state_from_peers(self) -> None:
        """Download the swarm's current state (bounded by the peer's load_state_timeout)."""

    @abc.abstractmethod
    def adopt_swarm_state(self, should_stop: Callable[[], bool], floor: int = 0) -> bool:
        """Back from being cut off: load the swarm's state even when its step is lower than this peer's (not
        lower than ``floor``). Returns whether it was loaded."""

    @abc.abstractmethod
    def share_state(self, on: bool) -> None:
        """Serve this peer's state to newcomers, or stop serving it (its state diverged from the swarm's)."""

    # --- the end -------------------------------------------------------------------------------------

    @abc.abstractmethod
    def cancel_rounds(self) -> None:
        """Cancel pending averaging rounds, so that a blocked step returns and shutdown proceeds in order."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    # --- the monitor's and the evaluation peer's copy --------------------------------------------------

    @staticmethod
    @abc.abstractmethod
    def state_holder(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
        """An averager that downloads, keeps and serves the swarm's state of this strategy for a monitor or an
        evaluation peer (``model`` holds its parameters)."""

    @staticmethod
    def reducer(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any | None:
        """An auxiliary reducer of this strategy's rounds (a cotrain.swarm.auxiliary.Reducer, not started) for
        a public peer that trains nothing, the monitor: it reduces all-reduce parts for the others with weight
        0 (``model``: a model of the run's shapes, which it may use as its own). None where the strategy has
        none."""
        return None


class HivemindStrategy(Strategy):
    """The parts of ``sync`` and ``diloco`` that work the same on their hivemind-style optimizer ``self.opt``
    (``local_epoch``, ``tracker``, ``state_averager``, ``last_group_size``, ``rounds_averaged/failed``)."""

    opt: Any
    run_id: str
    load_state_timeout: float

    @property
    def global_step(self) -> int:
        return int(self.opt.local_epoch)

    @property
    def swarm_step(self) -> int:
        return int(self.opt.tracker.global_epoch)

    @property
    def swarm_samples(self) -> int:
        return int(self.opt.tracker.global_progress.samples_accumulated)

    @property
    def num_peers(self) -> int:
        return int(self.opt.tracker.global_progress.num_peers)

    @property
    def last_group_size(self) -> int:
        return max(1, int(self.opt.last_group_size))

    @property
    def rounds(self) -> tuple[int, int]:
        return self.opt.rounds_averaged, self.opt.rounds_failed

    @property
    def samples_per_second(self) -> float:
        sps = float(self.opt.tracker.performance_ema.samples_per_second)
        return min(max(sps, 0.0), 1e5) if math.isfinite(sps) else 0.0

    @property
    def batch_size_per_step(self) -> int | None:
        return self.opt.batch_size_per_step

    @property
    def client_mode(self) -> bool:
        return bool(self.opt.client_mode)

    def step(self, samples: int) -> None:
        self.opt.step(batch_size=samples)

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def load_state_from_peers(self) -> None:
        self.opt.load_state_from_peers()

    def adopt_swarm_state(self, should_stop: Callable[[], bool], floor: int = 0) -> bool:
        from cotrain.swarm.healing import adopt_swarm_state

        return adopt_swarm_state(self.opt, self.run_id, self.load_state_timeout, should_stop, floor)

    def share_state(self, on: bool) -> None:
        self.opt.state_averager.allow_state_sharing = bool(on) and not self.client_mode

    def state_replaced(self) -> None:
        opt, averager = self.opt, self.opt.state_averager
        if not averager.reuse_tensors:
            load_local_tensors(averager)
        if opt.use_gradient_averaging:
            opt.grad_averager.reset_accumulated_grads_()
        opt.tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)

    def shutdown(self) -> None:
        self.cancel_rounds()
        try:
            self.opt.shutdown()
        except Exception as e:
            logger.debug(f"optimizer shutdown: {e!r}")


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
        from cotrain.swarm.liveness import cancel_controls

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
        state; it publishes its fingerprint and checks what it downloads (cotrain.swarm.statecheck)."""
        from hivemind.compression import NoCompression

        from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
        from cotrain.swarm.keys import progress_key, state_averager_prefix
        from cotrain.swarm.optimizer import request_timeout
        from cotrain.swarm.statecheck import CheckedTrainingStateAverager

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
        parts; cotrain.swarm.auxiliary.GradientReducer)."""
        from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
        from cotrain.swarm.auxiliary import GradientReducer

        params = parameter_groups(model, run.weight_decay)
        opt = sync_optimizer(
            dht, run, peer, params, optimizer_factory(run), scheduler_factory(run), None, auxiliary=True
        )
        return GradientReducer(opt)


class DiLoCoStrategy(HivemindStrategy):
    """DiLoCo (cotrain.swarm.diloco): ``run.local_steps`` inner steps of the preset's optimizer and schedule,
    then an outer Nesterov step on the swarm's averaged change; a round is ``local_steps x
    target_batch_size`` samples of the swarm."""

    name = "diloco"

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
        from cotrain.swarm.diloco import DiLoCoOptimizer
        from cotrain.swarm.optimizer import (
            gradient_compression,
            tracker_options,
        )
        from cotrain.swarm.sparse import codec_of

        averager_opts = averager_options(peer)
        self.run_id, self.load_state_timeout = run.run_id, peer.load_state_timeout
        self.opt = DiLoCoOptimizer(
            dht=dht,
            run_id=run.run_id,
            params=list(params),
            inner_optimizer=optimizer,
            inner_scheduler=scheduler,
            local_steps=run.local_steps,
            round_samples=max(1, run.local_steps * run.target_batch_size - peer.batch_size_lead),
            outer_lr=run.outer_lr,
            outer_momentum=run.outer_momentum,
            overlap=run.outer_overlap,
            matchmaking_time=peer.matchmaking_time,
            averaging_timeout=peer.averaging_timeout,
            load_state_timeout=peer.load_state_timeout,
            compression=gradient_compression(peer.grad_compression),
            batch_size_per_step=batch_size_per_step,
            averager_opts=averager_opts,
            aggregation=aggregation_of(run),
            tracker_opts=tracker_options(peer.matchmaking_time, tracker_settings(peer)),
            performance_ema_alpha=peer.performance_ema_alpha,
            verbose=peer.verbose,
            codec=codec_of(run.outer_compression, run.topk_density, run.topk_bits, run.topk_feedback_decay),
        )
        self.opt.should_stop = should_stop
        gain = run.outer_lr * (1 + run.outer_momentum)
        if run.outer_overlap and gain >= 1:
            logger.warning(
                f"--outer-overlap applies each outer step one round late: with an outer gain of {gain:.2f} "
                "(--outer-lr x (1 + --outer-momentum)) of 1 or more the global parameters can oscillate and "
                "diverge once a round's progress saturates; a gain below 1 (e.g. --outer-lr 0.5 "
                "--outer-momentum 0) is stable (docs/diloco.md)"
            )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (the preset's), which steps at every call of ``step``."""
        return self.opt.inner_optimizer

    @property
    def inner_steps(self) -> int:
        """Inner optimizer steps this peer took since it started."""
        return int(self.opt.inner_steps_done)

    @property
    def round_bytes(self) -> int:
        return int(self.opt.last_round_bytes)

    @property
    def inner(self) -> tuple[torch.optim.Optimizer, Any] | None:
        return self.opt.inner_optimizer, self.opt.inner_scheduler

    def cancel_rounds(self) -> None:
        self.opt.cancel_rounds()

    @contextlib.contextmanager
    def training_state(self) -> Iterator[tuple[torch.optim.Optimizer, Any, list[torch.Tensor]]]:
        """(outer optimizer, None, the model's parameters), locked: the outer optimizer holds the global
        parameters."""
        averager = self.opt.state_averager
        with averager.lock_averaged_tensors:
            yield averager.optimizer, None, averager.main_parameters

    @contextlib.contextmanager
    def checkpoint_state(self) -> Iterator[CheckpointParts]:
        """The global parameters in the model (the local ones come back afterwards), the outer optimizer, and
        the inner optimizer with its schedule."""
        averager = self.opt.state_averager
        with averager.global_in_model(), averager.lock_inner:
            yield CheckpointParts(
                averager.optimizer,
                None,
                list(averager.main_parameters),
                (averager.inner_optimizer, averager.inner_scheduler),
            )

    def resumed_at(self, step: int) -> None:
        self.opt.resumed_at(step)

    # the global parameters move only by outer steps checked finite, and a download is checked too
    state_is_backup = True

    def restore_from_state(self) -> bool:
        with self.training_state() as (optimizer, _, _params):
            if not all(bool(torch.isfinite(p).all()) for g in optimizer.param_groups for p in g["params"]):
                return False
        self.opt.restart_round()
        return True

    def model_parameters(self) -> list[torch.Tensor]:
        return list(self.opt.parameters)

    def attach_node(self, node: Any) -> None:
        """A round's end gathers the ranks' shards into this peer's model (the node's replica) and inner
        optimizer; its outer step, a download, a resume or a restore sends them back."""
        self.opt.node = node

    @staticmethod
    def state_holder(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
        """The monitor's copy of a DiLoCo swarm's state: global parameters (in ``model``), outer momentum,
        round, and an inner optimizer and schedule (never stepped: they hold what a trainer served)."""
        from hivemind.compression import NoCompression

        from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
        from cotrain.swarm.diloco_state import DiLoCoStateAverager, outer_optimizer_factory
        from cotrain.swarm.keys import progress_key, state_averager_prefix
        from cotrain.swarm.optimizer import request_timeout

        groups = parameter_groups(model, run.weight_decay)
        inner = optimizer_factory(run)(groups)
        return DiLoCoStateAverager(
            dht=dht,
            prefix=state_averager_prefix(run.run_id),
            progress_key=progress_key(run.run_id) if aggregation_of(run).robust else None,
            witnessed_key=progress_key(run.run_id),  # a served state's round is bounded by the swarm's
            optimizer=outer_optimizer_factory(run.outer_lr, run.outer_momentum),
            params=groups,
            inner_optimizer=inner,
            inner_scheduler=scheduler_factory(run)(inner),
            local_steps=run.local_steps,
            state_compression=NoCompression(),
            min_matchmaking_time=peer.matchmaking_time,
            request_timeout=request_timeout(peer.matchmaking_time),
            allow_state_sharing=False,
            keeps_state=True,
            status_loglevel=logging.INFO if peer.verbose else logging.DEBUG,
            start=True,
        )

    @staticmethod
    def reducer(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
        """The run's round averager in auxiliary mode (cotrain.swarm.auxiliary.RoundReducer)."""
        return diloco_reducer(dht, run, peer, model)
