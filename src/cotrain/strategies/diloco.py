"""``diloco``: each peer takes ``local_steps`` steps of the preset's optimizer alone, then the swarm averages
the parameters' change over the round and takes one outer Nesterov step (cotrain.strategies.diloco_rounds
runs the rounds); a round is ``local_steps x target_batch_size`` samples of the swarm."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from hivemind.compression import NoCompression

from cotrain.config import PeerConfig, RunConfig
from cotrain.config.demo import DEMO_LOCAL_STEPS
from cotrain.hivemind_ext.auxiliary import RoundReducer
from cotrain.hivemind_ext.diloco_state import DiLoCoStateAverager, outer_optimizer_factory
from cotrain.hivemind_ext.optimizer import request_timeout, tracker_options
from cotrain.hivemind_ext.outer import round_averager
from cotrain.hivemind_ext.progress import tracker_class
from cotrain.keys import progress_key, state_averager_prefix
from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
from cotrain.registry import codec
from cotrain.strategies.base import CheckpointParts, HivemindStrategy, Progress
from cotrain.strategies.builds import (
    aggregation_of,
    averager_options,
    grad_compression_of,
    round_codec,
    tracker_settings,
)
from cotrain.strategies.diloco_rounds import DiLoCoOptimizer

__all__ = ["DiLoCoStrategy", "diloco_reducer"]

logger = logging.getLogger(__name__)


def _megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class DiLoCoStrategy(HivemindStrategy):
    """DiLoCo (cotrain.strategies.diloco_rounds): ``run.local_steps`` inner steps of the preset's optimizer
    and schedule, then an outer Nesterov step on the swarm's averaged change; a round is ``local_steps x
    target_batch_size`` samples of the swarm."""

    name = "diloco"

    # --- what the roles show of it ---------------------------------------------------------------------

    step_name: ClassVar[str] = "outer round"
    peer_fields: ClassVar[tuple[str, ...]] = ("inner_steps", "round_bytes")
    ranks_over_devices: ClassVar[bool] = True
    attacked_in_rounds: ClassVar[bool] = True  # on the pseudo-gradient it sends (diloco_rounds)

    @staticmethod
    def samples_per_step(target_batch_size: int, local_steps: int) -> int:
        return target_batch_size * local_steps

    @classmethod
    def words(cls, run: RunConfig, peer: PeerConfig | None = None) -> str:
        overlap = ", overlapped" if run.outer_overlap else ""
        if peer is None:
            return (
                f"strategy diloco: outer rounds of {run.local_steps} x {run.target_batch_size} samples, "
                f"outer lr {run.outer_lr:g}, momentum {run.outer_momentum:g}{overlap}"
            )
        wire = f"{peer.grad_compression} on the wire"
        if run.outer_compression == "topk":
            wire = (
                f"top {run.topk_density:.2%} of each chunk in {run.topk_bits} bits on the wire, error "
                f"feedback x {run.topk_feedback_decay:g}"
            )
        return (
            f"strategy diloco (an outer round every {run.local_steps} x {run.target_batch_size} samples of "
            f"the swarm, outer lr {run.outer_lr:g}, momentum {run.outer_momentum:g}{overlap}, {wire})"
        )

    @classmethod
    def swarm_fields(cls, records: list[Any]) -> dict:
        """The inner steps (the most that any peer reports: each counts its own optimizer's steps since
        it started) and the payload of the peers' last outer all-reduce (most of a peer; the total)."""
        return {
            "inner_steps": max((r.inner_steps for r in records), default=0),
            "round_bytes": max((r.round_bytes for r in records), default=0),
            "round_bytes_total": sum(r.round_bytes for r in records),
        }

    @classmethod
    def step_words(cls, line: dict, style: str = "log") -> str:
        inner = f"{line.get('inner_steps', 0)} inner steps (most of a peer)"
        sent = line.get("round_bytes", 0) / 1e6
        if style == "demo":
            return f", {inner}, {sent:.1f} MB sent per peer in the last round"
        total = line["round_bytes_total"] / 1e6
        return f" | {inner} | last round sent {sent:.1f} MB per peer, {total:.1f} MB in all"

    @classmethod
    def settings_shown(cls, run: RunConfig) -> dict:
        """The compression of the rounds in force (a swarm-wide setting)."""
        shown: dict = {"outer_compression": run.outer_compression}
        if run.outer_compression == "topk":
            shown.update(
                topk_density=run.topk_density,
                topk_bits=run.topk_bits,
                topk_feedback_decay=run.topk_feedback_decay,
            )
        return shown

    @classmethod
    def status_lines(cls, state: dict) -> list[str]:
        sent, total = _megabytes(state.get("round_bytes", 0)), _megabytes(state.get("round_bytes_total", 0))
        local = state.get("local_steps", 0)
        line = (
            f"diloco: a round every {local} target batches ({local} x {state['target_batch_size']} samples "
            f"of the swarm), {state.get('inner_steps', 0)} inner steps so far (the most any peer took, one "
            f"per step of its own), last round sent {sent} per peer ({total} in all)"
        )
        if state.get("outer_compression") == "topk":
            line += (
                f"; sparse rounds: the top {state['topk_density']:.2%} of each chunk in "
                f"{state['topk_bits']} bits, error feedback x {state.get('topk_feedback_decay', 1.0):g}"
            )
        return [line]

    @classmethod
    def demo_run(cls, run: RunConfig, given: frozenset[str]) -> RunConfig:
        """With no --local-steps given, rounds of DEMO_LOCAL_STEPS x target_batch_size samples."""
        return run if "local_steps" in given else dataclasses.replace(run, local_steps=DEMO_LOCAL_STEPS)

    @classmethod
    def demo_words(cls, run: RunConfig, given: frozenset[str]) -> str:
        mine = "" if "local_steps" in given else " (the demo's; --local-steps sets it)"
        return (
            f"strategy diloco: --local-steps {run.local_steps}{mine}, an outer round every "
            f"{run.local_steps * run.target_batch_size} samples of the swarm"
        )

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
            compression=grad_compression_of(peer),
            bytes_per_value=codec(peer.grad_compression).bytes_per_value,
            batch_size_per_step=batch_size_per_step,
            averager_opts=averager_opts,
            aggregation=aggregation_of(run),
            tracker_opts=tracker_options(peer.matchmaking_time, tracker_settings(peer)),
            performance_ema_alpha=peer.performance_ema_alpha,
            verbose=peer.verbose,
            codec=round_codec(run),
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
    def progress(self) -> Progress:
        """The swarm's progress, with the inner steps this peer took since it started and the payload it sent
        in its last round."""
        return dataclasses.replace(
            super().progress,
            inner_steps=int(self.opt.inner_steps_done),
            round_bytes=int(self.opt.last_round_bytes),
            rounds_caught_up=int(self.opt.rounds_caught_up),
        )

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
        """The run's round averager in auxiliary mode (cotrain.hivemind_ext.auxiliary.RoundReducer)."""
        return diloco_reducer(dht, run, peer, model)


def diloco_reducer(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
    """DiLoCoStrategy.reducer: the run's round averager for ``model``'s parameters, in auxiliary mode, and a
    tracker of the run's rounds (cotrain.hivemind_ext.auxiliary.RoundReducer)."""
    averager_opts = averager_options(peer)
    request_timeout = averager_opts.pop("request_timeout")
    aggregation = aggregation_of(run)
    averager = round_averager(
        [p for group in parameter_groups(model, run.weight_decay) for p in group["params"]],
        dht,
        run_id=run.run_id,
        codec=round_codec(run),
        compression=grad_compression_of(peer),
        aggregation=aggregation,
        matchmaking_time=peer.matchmaking_time,
        request_timeout=request_timeout,
        averaging_timeout=peer.averaging_timeout,
        averager_opts=averager_opts,
        auxiliary=True,
        momentum=run.outer_momentum > 0,
    )
    tracker = tracker_class(aggregation.robust)(
        dht=dht,
        prefix=run.run_id,
        target_batch_size=max(1, run.local_steps * run.target_batch_size - peer.batch_size_lead),
        client_mode=False,
        status_loglevel=logging.INFO if peer.verbose else logging.DEBUG,
        follows_clients=True,
        start=True,
        **tracker_options(peer.matchmaking_time, tracker_settings(peer)),
    )
    return RoundReducer(averager, tracker, peer.matchmaking_time, peer.averaging_timeout)
