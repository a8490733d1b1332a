"""Training strategies: how a peer's local gradients become the swarm's steps.

A strategy owns the swarm-facing optimizer and the training state it averages; the engine (SwarmPeer) calls
it and never reaches into hivemind itself. ``sync`` is the seed recipe's large-batch synchronous SGD:
``hivemind.Optimizer`` accumulates the swarm's samples until ``target_batch_size``, averages gradients in
groups, and every peer takes the same optimizer step. ``diloco`` (cotrain.strategies.diloco_rounds) takes
``local_steps`` steps of the inner optimizer alone, then averages the parameters' change over the round and
takes one outer Nesterov step. A strategy is a subclass of ``Strategy``, registered in
``cotrain.registry.STRATEGIES``; its ``state_holder`` builds the averager through which the monitor and the
evaluation peer download, keep and serve the swarm's state.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from cotrain.config import PeerConfig, RunConfig
from cotrain.errors import UserError
from cotrain.hivemind_ext.hooks import load_local_tensors
from cotrain.net.healing import adopt_swarm_state

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


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a peer stands in the swarm, as it last saw it (``Strategy.progress``)."""

    swarm_step: int  # the swarm's global step
    swarm_samples: int  # samples the swarm has accumulated toward its next global step
    num_peers: int  # peers training in the run, this one included
    group_size: int  # peers in this peer's last averaging group, itself included (1: it stepped alone)
    rounds_averaged: int  # averaging rounds that succeeded so far
    rounds_failed: int  # and that failed
    samples_per_second: float  # this peer's training throughput, as it reports it to the swarm
    inner_steps: int = 0  # inner optimizer steps (diloco; 0 where there are none)
    round_bytes: int = 0  # payload this peer sent in its last round (diloco; 0 where it is not measured)
    rounds_caught_up: int = 0  # rounds the others averaged without it whose average it took (diloco)


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
    # from it (``restore_from_state``) instead of keeping a copy of it (cotrain.engine.backup)
    state_is_backup: ClassVar[bool] = False

    # --- progress ------------------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def global_step(self) -> int:
        """The swarm's global step this peer is at (diloco: outer rounds)."""

    @property
    @abc.abstractmethod
    def progress(self) -> Progress:
        """Where this peer stands in the swarm, as it last saw it."""

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

    # --- what the roles show of it (class-level: from the run's settings, before any peer is built) -----

    step_name: ClassVar[str] = "global step"  # what one global step is called in lines and pages
    # fields of LocalMetrics (cotrain.net.metrics) this strategy fills beyond the common ones: the monitor,
    # status, the dashboard and TensorBoard show them per peer and for the swarm
    peer_fields: ClassVar[tuple[str, ...]] = ()
    ranks_over_devices: ClassVar[bool] = False  # several GPUs of one machine train as ranks of one peer
    # where COTRAIN_ATTACK's peer attacks (cotrain.faults): within the strategy's own rounds, or on ``.grad``
    attacked_in_rounds: ClassVar[bool] = False

    @staticmethod
    def samples_per_step(target_batch_size: int, local_steps: int) -> int:
        """Samples the swarm accumulates per global step."""
        return target_batch_size

    @classmethod
    def words(cls, run: RunConfig, peer: PeerConfig | None = None) -> str:
        """The strategy in a few words for log lines (with ``peer``: the trainer's first line, which also
        says how this peer's rounds travel)."""
        return f"strategy {cls.name}"

    @classmethod
    def swarm_fields(cls, records: list[Any]) -> dict:
        """The swarm's figures of ``peer_fields`` from the peers' metrics records (the monitor's line and
        status)."""
        return {}

    @classmethod
    def step_words(cls, line: dict, style: str = "log") -> str:
        """What a line of the swarm's metrics adds for this strategy (``style``: the monitor's log or the
        demo's)."""
        return ""

    @classmethod
    def settings_shown(cls, run: RunConfig) -> dict:
        """The swarm-wide settings ``cotrain status`` adds to its state."""
        return {}

    @classmethod
    def status_lines(cls, state: dict) -> list[str]:
        """``cotrain status``'s lines about this strategy, from its state."""
        return []

    @classmethod
    def demo_run(cls, run: RunConfig, given: frozenset[str]) -> RunConfig:
        """The run the demo's peers get (``given``: the run settings a user set): a short demo."""
        return run

    @classmethod
    def demo_words(cls, run: RunConfig, given: frozenset[str]) -> str:
        """The demo's line about this strategy's settings ("" for none)."""
        return ""

    # --- the monitor's and the evaluation peer's copy --------------------------------------------------

    @staticmethod
    @abc.abstractmethod
    def state_holder(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
        """An averager that downloads, keeps and serves the swarm's state of this strategy for a monitor or an
        evaluation peer (``model`` holds its parameters)."""

    @staticmethod
    def reducer(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any | None:
        """An auxiliary reducer of this strategy's rounds (a cotrain.hivemind_ext.auxiliary.Reducer, not
        started) for a public peer that trains nothing, the monitor: it reduces all-reduce parts for the
        others with weight 0 (``model``: a model of the run's shapes, which it may use as its own). None where
        the strategy has none."""
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
    def progress(self) -> Progress:
        opt, tracker = self.opt, self.opt.tracker
        sps = float(tracker.performance_ema.samples_per_second)
        return Progress(
            swarm_step=int(tracker.global_epoch),
            swarm_samples=int(tracker.global_progress.samples_accumulated),
            num_peers=int(tracker.global_progress.num_peers),
            group_size=max(1, int(opt.last_group_size)),
            rounds_averaged=opt.rounds_averaged,
            rounds_failed=opt.rounds_failed,
            samples_per_second=min(max(sps, 0.0), 1e5) if math.isfinite(sps) else 0.0,
        )

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
