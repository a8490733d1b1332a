"""The state of a DiLoCo peer as hivemind serves and downloads it (``DiLoCoStateAverager``: global parameters,
outer momentum, round, inner optimizer and schedule), and the outer optimizer's pieces. The monitor's and the
evaluation peer's state holder is one too (cotrain.strategies.base).

What a downloader takes from a donor beyond the checked fingerprint of its global parameters
(cotrain.hivemind_ext.statecheck) is checked too:
- the round (``round_refusal``): a round more than ``ROUND_SLACK`` beyond the one the swarm's progress
  records witness (the largest that two other peers' records reach, the donor's among them:
  cotrain.hivemind_ext.progress.witnessed_epoch), or beyond ``MAX_ROUND`` where fewer than two records are
  read, is refused, and the next donor asked; an inner step (the schedule's position) outside the round's
  range (``round x local_steps`` to ``(round + 1) x local_steps``) is not taken: the newcomer starts at its
  round's first. A donor on the unverified fallback could otherwise put a newcomer at round 2^60, where it
  averages with nobody again, or at the end of the inner schedule;
- the lineage (cotrain.algorithms.lineage) it serves with the state: kept only where another peer's record for
  that round attests the same lineage and the state matches every such record, momentum included
  (``DiLoCoStateAverager.settle_download``, fingerprint.lineage_attested); otherwise the newcomer starts a
  fresh lineage, and its first round averages the outer state with its group. Each holder's record attests
  the lineage it vouches for, with the fingerprint of its outer momentum (``attestation``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.optim.state_averager import (
    TrainingStateAverager,
    dump_optimizer_state,
    load_optimizer_state,
)
from hivemind.utils import nested_pack

from cotrain.algorithms.fingerprint import fingerprint, lineage_attested
from cotrain.algorithms.lineage import LINEAGE_BYTES
from cotrain.hivemind_ext.hooks import Averager, apply_optimizer_parameters
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.statecheck import MAX_STEP, CheckedStateDownloads, Published

logger = logging.getLogger(__name__)

STRATEGY = "diloco"  # what a served state says it is, so that a state of another strategy is refused
ROUND_SLACK = 2  # rounds a served state may be ahead of the witnessed one (records lag a round's end)
MAX_ROUND = MAX_STEP  # the most a served round may be where no other peer's progress is read


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def round_refusal(epoch: Any, inner_steps: Any, witnessed: int | None, local_steps: int) -> str | None:
    """Why a served DiLoCo state's round ``epoch`` is out of range (what the donor served, for a log line), or
    None: the round must be at most ``ROUND_SLACK`` beyond ``witnessed`` (the round the swarm's progress
    records witness; ``MAX_ROUND`` when None). Its inner step is not a reason to refuse it (a resumed
    monitor's copy serves 0): the download takes it only within its round's range (see the module's doc)."""
    if not _is_int(epoch) or epoch < 0:
        return f"a state without a valid round ({epoch!r})"
    if witnessed is None and epoch > MAX_ROUND:
        return f"a state at round {epoch}, beyond any run's ({MAX_ROUND})"
    if witnessed is not None and epoch > witnessed + ROUND_SLACK:
        return (
            f"a state at round {epoch}, beyond the round the swarm's progress records witness ({witnessed}, "
            f"+{ROUND_SLACK})"
        )
    return None


def outer_optimizer_factory(lr: float, momentum: float) -> Callable[[Iterable], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, no weight decay (the inner optimizer's). Only the
    groups' parameters are kept: an inner optimizer built on the same group dicts filled them with its own
    learning rate and settings."""

    def make(groups):
        groups = [{"params": g["params"]} if isinstance(g, dict) else g for g in groups]
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return make


@torch.no_grad()
def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's statistics without moving its parameters (a step at lr 0 on zero gradients),
    so that its state has the same layout before and after a download."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(optimizer.state.get(p) for p in params):
        return
    saved = [(g["lr"], g.get("weight_decay")) for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        if "weight_decay" in g:
            g["weight_decay"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad
    for g, (lr, wd) in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
        if wd is not None:
            g["weight_decay"] = wd


def set_schedule(scheduler: Any, inner_steps: int) -> None:
    """Move an LR scheduler (a LambdaLR: the presets' warmup-then-decay) to ``inner_steps``."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
        scheduler.last_epoch = int(inner_steps) - 1
        scheduler.step()


class DiLoCoStateAverager(ServedInThread, CheckedStateDownloads, TrainingStateAverager, Averager):
    """A DiLoCo peer's state as hivemind serves and downloads it: the global parameters (the offloaded outer
    optimizer's parameters), the outer optimizer's momentum and the round (``local_epoch``), with the inner
    optimizer's statistics and its step riding along. The model's own parameters are the local ones. A
    download is checked against the fingerprints of the global parameters that peers publish
    (cotrain.hivemind_ext.statecheck)."""

    def __init__(
        self,
        *,
        inner_optimizer: torch.optim.Optimizer,
        inner_scheduler: Any,
        local_steps: int,
        **kwargs: Any,
    ) -> None:
        self.inner_optimizer, self.inner_scheduler = inner_optimizer, inner_scheduler
        self.local_steps = local_steps
        self.lock_inner = threading.Lock()
        self.inner_steps = 0  # the inner schedule's position (the swarm's inner steps, local_steps per round)
        # the optimizer resets its round after a download, given the lineage the donor served with it (if any)
        self.on_loaded: Callable[[bytes | None], None] = lambda lineage: None
        # the lineage of a served state (its round, its tensors), where the optimizer vouches for it: a
        # newcomer that downloads it takes the lineage too, and its first round need not carry the state
        self.served_lineage: Callable[[Any, list[torch.Tensor]], bytes | None] = lambda epoch, tensors: None
        initialize_state(inner_optimizer)
        super().__init__(offload_optimizer=True, custom_gradients=True, reuse_tensors=True, **kwargs)
        # hivemind gives an offloaded optimizer's parameters zero gradients to copy the model's into; the
        # outer step lends them the round's average for its duration instead (DiLoCoOptimizer._outer_step):
        # 4 bytes per parameter that nothing else holds
        for param in self.global_parameters:
            param.grad = None
        momentum = self.optimizer.defaults.get("momentum", 0) > 0
        glob = self.global_parameters
        self.pinned_momentum = [torch.zeros_like(p).share_memory_() for p in glob] if momentum else []
        self.pin_momentum()
        # the outer optimizer's state as a served state packs it (its tensors: the pinned momentum, no copy)
        self._outer_layout = self.optimizer.state_dict()

    state_optimizers = (
        2  # the outer optimizer's statistics and the inner one's (cotrain.algorithms.statelimit)
    )

    @property
    def global_parameters(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def outer_state(self) -> list[torch.Tensor]:
        """The global parameters, then the outer optimizer's momentum buffers (the caller holds the lock). At
        outer momentum 0 SGD keeps no buffer: zeros stand in for it."""
        glob, state = self.global_parameters, self.optimizer.state
        buffers = [state[p].get("momentum_buffer") for p in glob]
        return [*glob, *(torch.zeros_like(p) if b is None else b for b, p in zip(buffers, glob, strict=True))]

    def pin_momentum(self) -> None:
        """With momentum, its buffers stay the same tensors, in shared memory, for the whole run (zeros before
        the first outer step, which SGD then treats as a missing buffer): a DiLoCo round's all-reduce averages
        them in place (cotrain.hivemind_ext.outer.round_averager). A loaded state is copied into them."""
        with torch.no_grad(), self.lock_averaged_tensors:
            for param, pinned in zip(self.global_parameters, self.pinned_momentum, strict=False):
                loaded = self.optimizer.state[param].get("momentum_buffer")
                if loaded is not pinned:
                    pinned.copy_(loaded) if loaded is not None else pinned.zero_()
                    self.optimizer.state[param]["momentum_buffer"] = pinned

    @contextlib.contextmanager
    def global_in_model(self) -> Iterator[None]:
        """The global parameters in the model for the duration (to save them), the local ones back after."""
        with torch.no_grad(), self.lock_averaged_tensors:
            local = [p.detach().clone() for p in self.main_parameters]
            for param, glob in zip(self.main_parameters, self.global_parameters, strict=True):
                param.copy_(glob)
            try:
                yield
            finally:
                for param, saved in zip(self.main_parameters, local, strict=True):
                    param.copy_(saved)

    # --- what a download checks (cotrain.hivemind_ext.statecheck; see the module's doc) ---

    def attestation(self, epoch: int, tensors: list[torch.Tensor]) -> tuple[bytes, list | None] | None:
        """The lineage this holder vouches for at ``epoch`` for ``tensors`` (the global parameters; under
        their lock) and its outer momentum (None at momentum 0), which its fingerprint record attests."""
        lineage = self.served_lineage(epoch, list(tensors))
        if lineage is None:
            return None
        return lineage, self.outer_state()[len(self.global_parameters) :] if self.pinned_momentum else None

    def served_refusal(self, metadata: Any, witnessed: int | None) -> str | None:
        return round_refusal(metadata.get("epoch"), metadata.get("inner_steps"), witnessed, self.local_steps)

    def settle_download(self, donor: str, loaded: tuple, records: Any) -> None:
        """Drop the lineage a donor served with its state unless another peer's record attests it for that
        state, momentum included (fingerprint.lineage_attested): the newcomer's first round then carries the
        outer state."""
        metadata, tensors = loaded
        lineage = metadata.get("lineage")
        if lineage is None:
            return
        epoch, count = metadata.get("epoch"), self._fingerprinted_count()
        others = [
            (p.steps[epoch], p.attested[epoch])
            for p in records.values()
            if isinstance(p, Published) and p.peer_id != donor and epoch in p.attested and epoch in p.steps
        ]
        momentum = self._served_momentum(metadata, tensors)
        if momentum is not False and isinstance(lineage, bytes) and len(lineage) == LINEAGE_BYTES:
            state = fingerprint(tensors[:count], epoch)
            moment = None if momentum is None else fingerprint(momentum, epoch)
            if lineage_attested(lineage, state, moment, others):
                return
        del metadata["lineage"]
        logger.info(
            f"No other peer's record attests the lineage peer {donor} served with its state for round "
            f"{epoch}: this peer starts a fresh one (its first round averages the outer state with its group)"
        )

    def _served_momentum(
        self, metadata: Any, tensors: list[torch.Tensor]
    ) -> list[torch.Tensor] | None | bool:
        """The outer momentum a served state holds, as loading it would read it (hivemind's
        ``load_optimizer_state``): one buffer per global parameter, zeros where it has none; None in a run
        without momentum; False where the state's outer optimizer statistics cannot be read so."""
        if not self.pinned_momentum:
            return None
        params = self.global_parameters
        n, outer = len(params) + len(self.extra_tensors), metadata.get("outer_tensors")
        try:
            flat, statistics = [], tensors[n:outer]
            for elem in metadata["optimizer_metadata"]:
                if elem.get("type") == "tensor" and isinstance(elem.get("index"), int):
                    flat.append(statistics[elem["index"]])
                elif elem.get("type") == "value" and "value" in elem:
                    flat.append(elem["value"])
            state = nested_pack(flat, structure=self._outer_layout)["state"]
            buffers = [state.get(i, {}).get("momentum_buffer") for i in range(len(params))]
        except Exception:
            return False
        if not all(
            b is None or (isinstance(b, torch.Tensor) and b.shape == p.shape)
            for b, p in zip(buffers, params, strict=True)
        ):
            return False
        return [torch.zeros_like(p) if b is None else b for b, p in zip(buffers, params, strict=True)]

    # --- serving and downloading ---

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        with self.lock_averaged_tensors:  # no outer step, download or outside write runs meanwhile
            lineage = self.served_lineage(metadata.get("epoch"), list(tensors))
            if lineage is not None:  # the values the lineage vouches for, copied before anything moves them
                tensors = [t.detach().clone() for t in tensors]
                metadata["lineage"] = lineage
        with self.lock_inner:
            inner_meta, inner_tensors = dump_optimizer_state(self.inner_optimizer)
            inner_tensors = [t.detach().cpu().clone() for t in inner_tensors]
            inner_steps = self.inner_steps
        metadata.update(
            strategy=STRATEGY, outer_tensors=len(tensors), inner_metadata=inner_meta, inner_steps=inner_steps
        )
        inner_infos = [
            CompressionInfo.from_tensor(t, key=("inner", i), role=TensorRole.OPTIMIZER)
            for i, t in enumerate(inner_tensors)
        ]
        return metadata, [*tensors, *inner_tensors], [*infos, *inner_infos]

    def load_state_from_peers(self, **kwargs: Any) -> bool | None:
        """Download the newest state a peer serves: global parameters (into the model too), outer momentum,
        round, inner optimizer and schedule. Returns True when loaded (None when nothing was)."""
        self.note_held_step()
        loaded = DecentralizedAverager.load_state_from_peers(self, **kwargs)
        if loaded is None:
            return None
        metadata, flat = loaded
        epoch, outer = metadata.get("epoch"), metadata.get("outer_tensors")
        if metadata.get("strategy") != STRATEGY or not isinstance(outer, int):
            logger.warning("A peer served a state that is not a DiLoCo state; not loading it")
            return None
        if not isinstance(epoch, int) or epoch < self.local_epoch:
            logger.warning("Not loading a peer's state: its round is behind this peer's")
            return None
        params = self.global_parameters
        n = len(params) + len(self.extra_tensors)
        if len(flat) < outer or outer < n:
            logger.error("A peer served an incomplete state; not loading it")
            return None
        with torch.no_grad(), self.lock_averaged_tensors:
            try:
                load_optimizer_state(self.optimizer, metadata["optimizer_metadata"], flat[n:outer])
            except (StopIteration, KeyError, IndexError, ValueError) as e:
                logger.warning(f"A peer served inconsistent outer optimizer statistics ({e!r}); not loading")
                return None
            for local, new in zip([*params, *self.extra_tensors], flat[:n], strict=True):
                local.copy_(new)
        with self.lock_inner:
            try:
                load_optimizer_state(self.inner_optimizer, metadata.get("inner_metadata", []), flat[outer:])
            except (StopIteration, KeyError, IndexError, ValueError) as e:
                logger.info(f"Inner optimizer statistics not loaded ({e!r}); this peer starts them afresh")
            steps = metadata.get("inner_steps")  # the round is checked (round_refusal); this, within it
            in_round = _is_int(steps) and epoch * self.local_steps <= steps <= (epoch + 1) * self.local_steps
            self.inner_steps = steps if in_round else epoch * self.local_steps
            set_schedule(self.inner_scheduler, self.inner_steps)
        apply_optimizer_parameters(self)
        self.local_epoch = epoch
        lineage = metadata.get("lineage")
        self.on_loaded(lineage if isinstance(lineage, bytes) and len(lineage) == LINEAGE_BYTES else None)
        return True
