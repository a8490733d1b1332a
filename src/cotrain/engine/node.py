"""A peer of several ranks (a *node*): one model sharded over N processes with FSDP2, one peer in the swarm.

Every rank holds a shard of the training model on its device (``torch.distributed.fsdp.fully_shard``, one
unit per transformer block) and a shard of the inner optimizer's state, and trains on micro-batches of its
own. Rank 0 alone meets the swarm: it keeps a full replica of the model on the host, which is the model its
``SwarmPeer`` (and so the DiLoCo strategy) holds, and it drives the other ranks with commands it broadcasts,
so that every rank runs the same collectives in the same order:

- ``MICRO``: forward and backward over the step's micro-batches (FSDP reduce-scatters the gradients); the
  node's loss is the ranks' mean;
- ``NORM``: the node's gradient norm, one all-reduce, clipped to ``max_norm`` where one is set;
- ``STEP`` / ``ZERO``: each rank steps (or zeroes) its shard of the inner optimizer, at the learning rates
  rank 0's schedule gives, so the swarm's schedule (set at every round) reaches every rank;
- ``PULL`` (a round's end): the full parameters and inner optimizer state are gathered into rank 0's
  replica, where the swarm's round runs as on a one-GPU peer;
- ``PUSH`` (after the outer step, a download, a resume, a restore): rank 0's replica is broadcast and each
  rank keeps its shard;
- ``STOP``.

Why rank 0 gathers, rather than each rank averaging its own shard with the same rank of other peers: a node
of any size meets any other (a 2-GPU peer averages with a 1-GPU peer and with an 8-GPU node), the swarm sees
one peer and one state (what a newcomer downloads, what a checkpoint holds, what ``cotrain export`` writes
are a one-GPU peer's), and the cost is host memory on rank 0 (the replica's parameters and inner optimizer
statistics) and one gather and one broadcast per round, not per step (docs/models.md, "A peer of several
GPUs").
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from cotrain import faults
from cotrain.engine.compute import accumulate_gradients
from cotrain.errors import UserError

logger = logging.getLogger(__name__)

STOP, MICRO, NORM, STEP, ZERO, PULL, PUSH = range(7)


class NodeError(UserError):
    """A collective of the node failed: another rank stopped."""


def check_shardable(model: torch.nn.Module, world: int) -> None:
    """Refuse, before any rank starts, a model too small for ``world`` ranks. FSDP splits every parameter by
    rows, and a rank past a parameter's rows holds an empty shard of it (fine); past the rows of the largest
    parameter, a rank would hold no part of the model at all."""
    name, param = max(model.named_parameters(), key=lambda item: item[1].shape[0] if item[1].dim() else 1)
    rows = param.shape[0] if param.dim() else 1
    if rows < world:
        raise UserError(
            f"--nproc-per-node {world}: the model is too small to shard over {world} ranks (its largest "
            f"parameter, {name}, has {rows} rows): a rank past them would hold no part of it; use at most "
            f"{rows} ranks"
        )


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` (on the host) sharded in place with FSDP2 over this node's ranks on ``device``: one unit per
    block the model names as not to be split (a transformer layer), then the rest (embeddings, head, final
    norm) as the root's. FSDP moves each unit to the device as it shards it, so a rank's device never holds
    more than one unit whole: a model larger than one GPU shards."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Node:
    """This rank's part of a node: its shard of the model and of the inner optimizer, and the commands.
    On rank 0, ``attach`` gives it the replica and the replica's inner optimizer (see the module's doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        groups: Callable[[torch.nn.Module], list[dict]],
        optimizer: Callable[[Iterable], torch.optim.Optimizer],
        device: torch.device,
    ) -> None:
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), device
        self.model = shard(model, device)
        self.optimizer = optimizer(groups(self.model))
        self.groups = len(self.optimizer.param_groups)
        self.comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.replica: torch.nn.Module | None = None  # rank 0: the full model its SwarmPeer holds
        self.replica_optimizer: torch.optim.Optimizer | None = None
        self.on_failure: Callable[[], str | None] = lambda: None  # which rank stopped, where it is known

    # --- rank 0's side -----------------------------------------------------------------------------

    def inner_optimizer(self, make: Callable[[Iterable], torch.optim.Optimizer]) -> Callable:
        """The inner optimizer factory for rank 0's replica: the preset's optimizer, whose state is the
        node's (gathered at a round's end, broadcast after a download) and whose ``step`` and ``zero_grad``
        step and zero every rank's shard."""
        node = self

        def step(self, closure=None):
            node.step([group["lr"] for group in self.param_groups])

        def zero_grad(self, set_to_none: bool = True):
            node.zero_grad()

        def build(groups: Iterable) -> torch.optim.Optimizer:
            opt = make(groups)
            opt.step = types.MethodType(step, opt)  # bound, as an LR scheduler wraps it
            opt.zero_grad = types.MethodType(zero_grad, opt)
            self.replica_optimizer = opt
            return opt

        return build

    def attach(self, replica: torch.nn.Module) -> None:
        self.replica = replica

    def pull(self) -> None:
        """Gather the node's parameters and inner optimizer state into the replica (a round's end)."""
        self._send(PULL)
        params, state = self._gather()
        named = dict(self.replica.named_parameters())
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(params[name])
        opt = self.replica_optimizer
        for name, values in state["state"].items():
            opt.state[named[name]] = dict(values)

    def push(self, optimizer: bool = True) -> None:
        """Broadcast the replica's parameters (and, with ``optimizer``, its inner optimizer's state where it
        has any) to every rank's shard."""
        opt = self.replica_optimizer
        optimizer = optimizer and bool(opt.state)
        self._send(PUSH, flag=float(optimizer))
        params = {name: t.detach() for name, t in self.replica.state_dict().items()}
        state = None
        if optimizer:
            names = {id(p): name for name, p in self.replica.named_parameters()}
            groups = [dict(g, params=[names[id(p)] for p in g["params"]]) for g in opt.param_groups]
            values = {names[id(p)]: v for p, v in opt.state.items() if id(p) in names}
            state = {"state": values, "param_groups": groups}
        self._scatter(params, state)

    def stop(self) -> None:
        """Tell the other ranks to stop (rank 0, at the end; a failed node is past telling)."""
        try:
            self._send(STOP)
        except NodeError:
            pass

    # --- every rank --------------------------------------------------------------------------------

    def accumulate(self, stream: Iterator[dict], accumulation: int, precision, loss_fn: Callable) -> float:
        """Forward and backward over ``accumulation`` micro-batches of this rank's ``stream``; the node's
        loss (the ranks' mean)."""
        self._send(MICRO)
        loss = self._collective(
            accumulate_gradients, self.model, stream, accumulation, self.device, precision, loss_fn
        )
        total = torch.tensor([loss], dtype=torch.float64, device=self.comm_device)
        self._collective(dist.all_reduce, total)
        return float(total) / self.world

    def gradient_norm(self, max_norm: float) -> float:
        """The node's gradient norm, clipping every shard to ``max_norm`` where it is positive."""
        self._send(NORM, flag=max_norm)
        grads = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            norm = self._collective(torch.nn.utils.clip_grad_norm_, grads, max_norm)
        else:
            norm = self._collective(torch.nn.utils.get_total_norm, [p.grad for p in grads])
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def step(self, lrs: list[float]) -> None:
        self._send(STEP, lrs=lrs)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        self._collective(self.optimizer.step)

    def zero_grad(self) -> None:
        self._send(ZERO)
        self.optimizer.zero_grad(set_to_none=True)

    def follow(self, stream: Iterator[dict], accumulation: int, precision, loss_fn: Callable) -> None:
        """A rank other than 0: run rank 0's commands until it says stop."""
        steps = 0
        while True:
            op, flag, lrs = self._receive()
            if op == STOP:
                return
            if op == MICRO:
                steps += 1
                if faults.rank_exits(self.rank, steps):  # COTRAIN_FAULT=rank-exit (tests)
                    os._exit(3)
                self.accumulate(stream, accumulation, precision, loss_fn)
            elif op == NORM:
                self.gradient_norm(flag)
            elif op == STEP:
                self.step(lrs)
            elif op == ZERO:
                self.zero_grad()
            elif op == PULL:
                self._gather()
            elif op == PUSH:
                self._scatter({}, {} if flag else None)
            else:
                raise NodeError(f"rank 0 sent an unknown command {op}")

    # --- the collectives ---------------------------------------------------------------------------

    def _send(self, op: int, flag: float = 0.0, lrs: list[float] | None = None) -> None:
        if self.rank != 0:
            return
        message = torch.zeros(2 + self.groups, dtype=torch.float64)
        message[0], message[1] = op, flag
        if lrs is not None:
            message[2:] = torch.tensor(lrs, dtype=torch.float64)
        self._collective(dist.broadcast, message.to(self.comm_device), 0)

    def _receive(self) -> tuple[int, float, list[float]]:
        message = torch.zeros(2 + self.groups, dtype=torch.float64, device=self.comm_device)
        self._collective(dist.broadcast, message, 0)
        values = message.cpu().tolist()
        return int(values[0]), values[1], values[2:]

    def _gather(self) -> tuple[dict, dict]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        params = self._collective(get_model_state_dict, self.model, options=options)
        state = self._collective(get_optimizer_state_dict, self.model, self.optimizer, options=options)
        return params, state

    def _scatter(self, params: dict, state: dict | None) -> None:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        self._collective(set_model_state_dict, self.model, params, options=options)
        if state is not None:
            self._collective(set_optimizer_state_dict, self.model, self.optimizer, state, options=options)

    def _collective(self, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            who = self.on_failure()  # known where this peer launched its ranks
            if who is None:
                lines = str(e).strip().splitlines()
                who = f"a collective of this peer's ranks failed ({lines[-1][:120] if lines else e!r})"
            raise NodeError(f"{who}: rank {self.rank} of this peer stops too") from None
