"""Every fault-injection hook for tests and benchmarks, in one place.

Each hook is switched on by an environment variable of the peer's process and does nothing otherwise:

- ``COTRAIN_DEBUG_NAN_AT_STEP=N``: one NaN in the gradients of the first micro-batch at global step N (the
  loss stays finite), as a numerically broken batch would produce.
- ``COTRAIN_DEBUG_CORRUPT_PARAMS_AT_STEP=N``: a parameter filled with NaN right after global step N, as a
  diverging optimizer step would leave it.
- ``COTRAIN_DEBUG_SAVE_ON_START``: a trainer saves a local checkpoint right after catching up with the swarm.
- ``COTRAIN_DEBUG_SAVE_EVALUATED``: the evaluation peer also saves each state it evaluated.
- ``COTRAIN_FAULT=checkpoint-before-rename[:N]``: the process exits after writing a checkpoint's temporary
  folder, before renaming it into place (at a save into a folder that holds N checkpoints already), as a
  crash mid-write would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

NAN_AT_STEP = "COTRAIN_DEBUG_NAN_AT_STEP"
CORRUPT_PARAMS_AT_STEP = "COTRAIN_DEBUG_CORRUPT_PARAMS_AT_STEP"
SAVE_ON_START = "COTRAIN_DEBUG_SAVE_ON_START"
SAVE_EVALUATED = "COTRAIN_DEBUG_SAVE_EVALUATED"
CHECKPOINT = "COTRAIN_FAULT"


def enabled(name: str) -> bool:
    return bool(os.environ.get(name))


def _step_of(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else None


class Faults:
    """The step-triggered hooks of one peer, each firing once."""

    def __init__(self) -> None:
        self.nan_at = _step_of(NAN_AT_STEP)
        self.corrupt_at = _step_of(CORRUPT_PARAMS_AT_STEP)

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
