"""Every fault-injection hook for tests and benchmarks, in one place.

Each hook is switched on by an environment variable of the peer's process and does nothing otherwise:

- ``COTRAIN_DEBUG_NAN_AT_STEP=N``: one NaN in the gradients of the first micro-batch at global step N (the
  loss stays finite), as a numerically broken batch would produce.
- ``COTRAIN_DEBUG_CORRUPT_PARAMS_AT_STEP=N``: a parameter filled with NaN right after global step N, as a
  diverging optimizer step would leave it.
- ``COTRAIN_DEBUG_SAVE_ON_START``: a trainer saves a local checkpoint right after catching up with the swarm.
- ``COTRAIN_DEBUG_SAVE_EVALUATED``: the evaluation peer also saves each state it evaluated.
- ``COTRAIN_DEBUG_UNREACHABLE``: the reachability probe asks to be dialed back at a closed port of 127.0.0.1,
  as a peer behind NAT is dialed in vain at the addresses it announces (``unreachable_addresses``).
- ``COTRAIN_FAULT=checkpoint-before-rename[:N]``: the process exits after writing a checkpoint's temporary
  folder, before renaming it into place (at a save into a folder that holds N checkpoints already), as a
  crash mid-write would.
- ``COTRAIN_FAULT=rank-exit[:N]``: every rank but 0 of a peer of several ranks exits at its N-th step
  (default: the first), in the middle of the node's step, as a crashed GPU process would (``rank_exits``).
- ``COTRAIN_ATTACK=<attack>`` (``COTRAIN_ATTACK_SCALE``, default 1000): a malicious peer, for the robustness
  tests and ``benchmarks/byzantine.py``: ``sign-flip``, ``random-direction``, ``stale``, ``constant``, ``nan``
  (what it sends in place of its gradient or pseudo-gradient, ``Attack``), ``label-shuffle``
  (``attack_batches``), ``inflate-progress`` (``Attack.before_step``), ``huge-weight`` (diloco: its all-reduce
  weight is the scale, e.g. 1e39: finite as a double, Inf in float32; ``Attack.weight``), ``silent``
  (``silent_allreduce``).
- ``COTRAIN_ATTACK=poisoned-state``: a trainer that trains honestly but serves newcomers corrupted parameters
  (``PoisonedState``), asked first by downloaders that follow hivemind's priorities.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from cotrain.registry import DEFAULT_STRATEGY, strategy_class

logger = logging.getLogger(__name__)

NAN_AT_STEP = "COTRAIN_DEBUG_NAN_AT_STEP"
CORRUPT_PARAMS_AT_STEP = "COTRAIN_DEBUG_CORRUPT_PARAMS_AT_STEP"
SAVE_ON_START = "COTRAIN_DEBUG_SAVE_ON_START"
SAVE_EVALUATED = "COTRAIN_DEBUG_SAVE_EVALUATED"
CHECKPOINT = "COTRAIN_FAULT"
UNREACHABLE = "COTRAIN_DEBUG_UNREACHABLE"
CLOSED_PORT = "/ip4/127.0.0.1/tcp/1"  # nothing listens on port 1 (tcpmux) on a test machine


def enabled(name: str) -> bool:
    return bool(os.environ.get(name))


def unreachable_addresses(addresses: list[str]) -> list[str]:
    """The addresses a reachability probe asks to be dialed back at: ``addresses``, or with
    COTRAIN_DEBUG_UNREACHABLE a closed port."""
    return [CLOSED_PORT] if enabled(UNREACHABLE) else list(addresses)


def _step_of(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else None


class Faults:
    """The step-triggered hooks of one peer, each firing once."""

    def __init__(self) -> None:
        self.nan_at = _step_of(NAN_AT_STEP)
        self.corrupt_at = _step_of(CORRUPT_PARAMS_AT_STEP)

    @property
    def active(self) -> bool:
        """Whether a hook is still to fire."""
        return self.nan_at is not None or self.corrupt_at is not None

    def poison_gradients(self, params: Iterable[torch.Tensor], step: int) -> None:
        """NAN_AT_STEP: one NaN in the first gradient once this peer is at global step N."""
        if self.nan_at is None or step < self.nan_at:
            return
        self.nan_at = None
        grad = next(p.grad for p in params if p.grad is not None)
        grad.view(-1)[0] = float("nan")
        logger.warning(f"Fault injection: a NaN gradient at step {step}")

    def corrupt_parameters(self, tensors: Iterable[torch.Tensor], step: int) -> None:
        """CORRUPT_PARAMS_AT_STEP: fill the given tensors with NaN once this peer reaches global step N."""
        if self.corrupt_at is None or step < self.corrupt_at:
            return
        self.corrupt_at = None
        with torch.no_grad():
            for t in tensors:
                t.fill_(float("nan"))
        logger.warning(f"{CORRUPT_PARAMS_AT_STEP}: filled a parameter with NaN at global step {step}")


def crash_point(point: str, existing_checkpoints: int) -> bool:
    """CHECKPOINT=point[:N]: whether a checkpoint save into a folder that already holds
    ``existing_checkpoints`` should stop the process at ``point`` (``checkpoint-before-rename``: its
    temporary folder complete, not renamed yet); no N: the first save."""
    name, _, count = os.environ.get(CHECKPOINT, "").partition(":")
    return name == point and existing_checkpoints >= int(count or 0)


def rank_exits(rank: int, steps: int) -> bool:
    """CHECKPOINT=rank-exit[:N]: whether this rank (never rank 0) exits now, at its ``steps``-th step."""
    name, _, count = os.environ.get(CHECKPOINT, "").partition(":")
    return name == "rank-exit" and rank > 0 and steps >= int(count or 1)


# --- malicious peers (COTRAIN_ATTACK) -----------------------------------------------------------------------

ATTACK = "COTRAIN_ATTACK"
ATTACK_SCALE = "COTRAIN_ATTACK_SCALE"
DEFAULT_ATTACK_SCALE = 1000.0
# what a malicious peer sends in place of its gradient (sync) or pseudo-gradient (diloco)
GRADIENT_ATTACKS = ("sign-flip", "random-direction", "stale", "constant", "nan")
ATTACKS = (*GRADIENT_ATTACKS, "label-shuffle", "inflate-progress", "huge-weight", "silent", "poisoned-state")
LABEL_SEED = 0  # every label-shuffling peer maps the labels alike (colluding attackers pull one way)


def attack_name() -> str:
    """The attack this process runs (ATTACK), "" for an honest peer."""
    name = os.environ.get(ATTACK, "").strip()
    if name and name not in ATTACKS:
        raise ValueError(f"{ATTACK}={name!r}: the attacks are {', '.join(ATTACKS)}")
    return name


def attack_scale() -> float:
    """ATTACK_SCALE: how hard the attack pushes (default DEFAULT_ATTACK_SCALE)."""
    value = os.environ.get(ATTACK_SCALE, "").strip()
    return float(value) if value else DEFAULT_ATTACK_SCALE


class Attack:
    """What a malicious peer (ATTACK=name, ATTACK_SCALE=scale) does to what it sends the swarm.

    Gradient attacks replace the vector the peer puts on the wire: ``sign-flip`` (-scale x the honest one),
    ``random-direction`` (a random direction, scale x the honest norm), ``stale`` (the first one it computed,
    sent forever), ``constant`` (every value = scale), ``nan`` (NaN and +Inf alternating). With the sync
    strategy the vector is the gradient, changed after the engine's clipping and finiteness check
    (``before_step``); with diloco it is the round's pseudo-gradient (``pseudo_gradient``: an attacked
    ``.grad`` would be normalised away by the inner optimizer). ``inflate-progress`` reports scale x the
    samples behind each step (to the progress tracker and as its all-reduce weight). ``label-shuffle``
    (``attack_batches``) and ``silent`` (``silent_allreduce``) act elsewhere. An Attack with ``name`` ""
    changes nothing."""

    def __init__(self, name: str = "", scale: float = DEFAULT_ATTACK_SCALE, on_gradients: bool = True):
        if name and name not in ATTACKS:
            raise ValueError(f"unknown attack {name!r}: the attacks are {', '.join(ATTACKS)}")
        if not scale > 0:
            raise ValueError(f"the attack's scale must be positive, got {scale}")
        self.name, self.scale, self.on_gradients = name, float(scale), on_gradients
        self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.stale: list[torch.Tensor] | None = None

    @classmethod
    def from_env(cls, strategy: str = DEFAULT_STRATEGY, announce: bool = True) -> Attack:
        """The attack ATTACK asks for. ``strategy``: the peer's (its gradient attacks act on ``.grad`` before
        each step unless the strategy attacks within its own rounds: ``Strategy.attacked_in_rounds``);
        ``announce``: log the one warning line that says this peer attacks."""
        in_rounds = strategy_class(strategy).attacked_in_rounds
        attack = cls(attack_name(), attack_scale(), on_gradients=not in_rounds)
        if attack.name and announce:
            logger.warning(
                f"Fault injection: this peer attacks the swarm ({ATTACK}={attack.name}, scale "
                f"{attack.scale:g}, strategy {strategy})"
            )
        return attack

    def before_step(self, params: Iterable[torch.Tensor], samples: int) -> int:
        """SwarmPeer.step, right before the strategy's step: attack the gradients in ``params``' ``.grad``
        (sync) in place; returns the samples to report for them."""
        if self.name in GRADIENT_ATTACKS and self.on_gradients:
            with torch.no_grad():
                self._replace([p.grad for p in params if p.grad is not None])
        if self.name == "inflate-progress":
            return max(1, round(samples * self.scale))
        return samples

    def weight(self, weight: float) -> float:
        """DiLoCo: the weight this peer sends with its round's all-reduce parts in place of ``weight``."""
        return self.scale if self.name == "huge-weight" else weight

    def pseudo_gradient(self, own: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """DiLoCo: the pseudo-gradient this peer sends in place of ``own`` (left unchanged)."""
        if self.name not in GRADIENT_ATTACKS:
            return list(own)
        sent = [t.detach().clone() for t in own]
        with torch.no_grad():
            self._replace(sent)
        return sent

    def _replace(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        if self.name == "sign-flip":
            for t in tensors:
                t.mul_(-self.scale)
        elif self.name == "random-direction":
            norm = _total_norm(tensors)
            noise = [torch.randn(t.shape, generator=self.generator) for t in tensors]
            factor = self.scale * float(norm) / max(float(_total_norm(noise)), 1e-30)
            for t, n in zip(tensors, noise, strict=True):
                t.copy_(n * factor)
        elif self.name == "stale":
            if self.stale is None:
                self.stale = [t.detach().clone() for t in tensors]
            for t, old in zip(tensors, self.stale, strict=True):
                t.copy_(old)
        elif self.name == "constant":
            for t in tensors:
                t.fill_(self.scale)
        elif self.name == "nan":
            for t in tensors:
                values = torch.full_like(t, float("nan"))
                values.view(-1)[1::2] = float("inf")
                t.copy_(values)


def _total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))


def attack_batches(stream: Iterator[dict], vocab_size: int) -> Iterator[dict]:
    """ATTACK=label-shuffle: the trainer's micro-batches with wrong labels, the data-level attack whose
    gradients look honest: every label token is mapped through one fixed random permutation of the
    vocabulary (the same on every attacker), and ALBERT's sentence-order labels are flipped. Any other
    attack: ``stream`` itself."""
    if attack_name() != "label-shuffle":
        return stream
    return _shuffled_labels(stream, vocab_size)


def _shuffled_labels(stream: Iterator[dict], vocab_size: int) -> Iterator[dict]:
    permutation = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(LABEL_SEED))
    for batch in stream:
        yield shuffle_labels(batch, permutation)


def shuffle_labels(batch: dict, permutation: torch.Tensor) -> dict:
    """``batch`` with its labels mapped through ``permutation`` (ignored positions stay ignored) and its
    sentence-order labels flipped."""
    batch = dict(batch)
    if "labels" in batch:
        labels = batch["labels"].clone()
        real = labels >= 0
        labels[real] = permutation[labels[real]]
        batch["labels"] = labels
    if "sentence_order_label" in batch:
        batch["sentence_order_label"] = 1 - batch["sentence_order_label"]
    return batch


async def silent_allreduce(runner_future: Any, timeout: float | None) -> None:
    """ATTACK=silent, in the averager's process at the start of a group's all-reduce (the averagers of
    cotrain.hivemind_ext.reducers: the sync strategy's gradients, DiLoCo's pseudo-gradients; state averaging
    is left alone): the peer joined the group and now sends nothing and reduces nothing. It never hands its
    groupmates the all-reduce runner (their parts for it wait unanswered until their timeouts), keeps quiet
    until just before the all-reduce's ``timeout`` (SILENT_WAIT when there is none), then fails the round for
    itself. Returns at once for any other attack."""
    if attack_name() != "silent":
        return
    # hivemind only here, in an averager's process: checkpoints and a node's ranks import faults without it
    from cotrain.hivemind_ext.unexported import AllreduceException

    try:
        await asyncio.sleep(max(0.0, timeout - 1.0) if timeout else SILENT_WAIT)
    finally:
        if runner_future is not None and not runner_future.done():
            runner_future.cancel()  # groupmates' requests still waiting for the runner end now
    raise AllreduceException("a silent group member sent nothing (fault injection)")


SILENT_WAIT = 60.0  # seconds a silent member keeps quiet in an all-reduce that has no timeout


# --- a poisoned served state (COTRAIN_ATTACK=poisoned-state) ------------------------------------------------

POISONED_STATE = "poisoned-state"
POISONED_PRIORITY_BONUS = 0.5  # above every honest peer at the same step, below the next step


class PoisonedState:
    """ATTACK=poisoned-state: a state holder that trains (and averages) honestly but serves whoever downloads
    its state a corrupted copy: each of its parameters (the first ``count`` tensors served) replaced by random
    values of the same norm, the hardest corruption for a check of norms alone. It declares a priority half a
    step above its own step, so a downloader that follows hivemind's order (highest priority first) asks it
    before any honest peer at that step, and it publishes the fingerprint of its honest state, as a liar
    would (cotrain.hivemind_ext.statecheck). Inactive (serves what it holds) for any other ATTACK."""

    def __init__(self, active: bool = False) -> None:
        self.active = active
        self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.warned = False

    @classmethod
    def from_env(cls) -> PoisonedState:
        return cls(os.environ.get(ATTACK, "").strip() == POISONED_STATE)

    def priority(self, value: float) -> float:
        return value + POISONED_PRIORITY_BONUS if self.active else value

    @torch.no_grad()
    def serve(self, tensors: Sequence[torch.Tensor], count: int) -> list[torch.Tensor]:
        """The tensors to serve: the first ``count`` replaced by new random tensors of their norms."""
        if not self.active:
            return list(tensors)
        out = list(tensors)
        for i, t in enumerate(out[:count]):
            noise = torch.randn(t.shape, generator=self.generator).to(t.dtype)
            norm = torch.linalg.vector_norm(t.float())
            out[i] = noise * (norm / torch.linalg.vector_norm(noise.float()).clamp(min=1e-30)).to(t.dtype)
        if not self.warned:
            logger.warning(f"Fault injection ({ATTACK}={POISONED_STATE}): serving a poisoned state")
            self.warned = True
        return out
