"""Where and how a trainer computes: its devices, mixed precision, and the automatic micro-batch size.

- ``resolve_devices("cuda:0,cuda:1")`` -> the torch devices of one peer; several GPUs train one model through
  ``torch.nn.DataParallel`` (one micro-batch split across them, as the original trainer did).
- ``Precision``: ``torch.autocast`` in float16 or bfloat16. float16 also scales the loss with a
  ``torch.amp.GradScaler``: each micro-batch's gradients are unscaled (and checked for inf/NaN) before
  ``hivemind.Optimizer`` accumulates them, so what the swarm averages is always unscaled.
  (``hivemind.GradScaler`` exists for ``reuse_grad_buffers=True``, where scaled gradients stay in the model's
  buffers across steps; cotrain accumulates in hivemind's own buffers, where the standard scaler is right.)
- ``auto_micro_batch``: ``--per-device-train-batch-size auto`` tries micro-batches of 1, 2, 4, ... with a real
  forward and backward pass on the GPU until one runs out of memory; on a CPU it takes CPU_MICRO_BATCH.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable

import torch

from cotrain.errors import UserError

logger = logging.getLogger(__name__)

CPU_MICRO_BATCH = 4  # `auto` on a CPU: memory is rarely the limit there, time per micro-batch is


def resolve_devices(spec: str) -> list[torch.device]:
    """The devices named by --devices ("" = the first GPU, else the CPU; "all" = every local GPU)."""
    gpus = torch.cuda.device_count()
    spec = spec.strip().lower()
    if not spec:
        return [torch.device("cuda", 0) if gpus else torch.device("cpu")]
    if spec == "cpu":
        return [torch.device("cpu")]
    if spec == "all":
        if not gpus:
            raise UserError("--devices all: no GPU is visible to torch on this machine")
        return [torch.device("cuda", i) for i in range(gpus)]
    devices: list[torch.device] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            device = torch.device(part)
        except RuntimeError:
            raise UserError(f"--devices: {part!r} is not a device (cpu, cuda, cuda:N or all)") from None
        if device.type != "cuda":
            raise UserError(f"--devices: list GPUs only (cuda:0,cuda:1), or give cpu alone; got {spec!r}")
        device = torch.device("cuda", device.index or 0)
        if device.index >= gpus:
            raise UserError(f"--devices: {part} does not exist here ({gpus} GPU(s) visible to torch)")
        if device in devices:
            raise UserError(f"--devices: {part} is listed twice")
        devices.append(device)
    return devices


def parallel(model: torch.nn.Module, devices: list[torch.device]) -> torch.nn.Module:
    """The model on its first device; with several GPUs, wrapped in DataParallel over all of them."""
    model.to(devices[0])
    if len(devices) > 1:
        return torch.nn.DataParallel(model, device_ids=[d.index for d in devices], output_device=devices[0])
    return model


class Precision:
    """Mixed precision for one device type: an autocast context and, for float16, per-micro-batch loss
    scaling."""

    def __init__(self, device: torch.device, fp16: bool = False, bf16: bool = False):
        self.device_type = device.type
        self.dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None
        self._probe: torch.optim.Optimizer | None = None

    @property
    def name(self) -> str:
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.dtype, "fp32")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, model: torch.nn.Module) -> None:
        """Bring the model's gradients back to their true scale (float16 only; a no-op otherwise)."""
        if self.scaler is None:
            return
        if self._probe is None:  # never stepped: it only tells the scaler which gradients to unscale
            self._probe = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        self.scaler.unscale_(self._probe)

    def update(self) -> None:
        """After each micro-step: lower the scale after an overflow, raise it after a run of good steps."""
        if self.scaler is not None:
            self.scaler.update()


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest of 1, 2, 4, ... (and ``limit`` itself) not above ``limit`` for which ``fits`` holds,
    trying them in increasing order and stopping at the first that does not fit; 0 if even 1 does not."""
    best, size = 0, 1
    while size <= limit:
        if not fits(size):
            return best
        best = size
        if size == limit:
            break
        size = min(size * 2, limit)
    return best


def accumulation_for(samples_per_step: int, micro: int) -> int:
    """Micro-batches per optimizer.step that make up ``samples_per_step`` (at least one)."""
    return max(1, math.ceil(samples_per_step / micro))


def gpu_probe(
    model: torch.nn.Module,
    make_batch: Callable[[int], dict],
    forward_loss: Callable[[torch.nn.Module, dict], torch.Tensor],
    device: torch.device,
    precision: Precision,
) -> Callable[[int], bool]:
    """``fits(size)``: one real forward and backward pass of a micro-batch of ``size`` longest examples on
    ``device``, with room kept for hivemind's gradient accumulators (one more copy of the parameters)."""

    def fits(size: int) -> bool:
        reserve = [torch.empty_like(p) for p in model.parameters()]
        try:
            batch = {k: v.to(device) for k, v in make_batch(size).items()}
            with precision.autocast():
                loss = forward_loss(model, batch)
            loss.float().mean().backward()
            torch.cuda.synchronize(device)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            del reserve
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    return fits


def auto_micro_batch(
    samples_per_step: int, device: torch.device, fits: Callable[[int], bool] | None
) -> tuple[int, int]:
    """(micro-batch, gradient accumulation) for ``--per-device-train-batch-size auto``: on a GPU the largest
    micro-batch that fits (``fits`` runs the real probe), on a CPU CPU_MICRO_BATCH; accumulation makes up
    ``samples_per_step``."""
    if device.type != "cuda" or fits is None:
        micro = min(CPU_MICRO_BATCH, samples_per_step)
    else:
        micro = largest_fitting(fits, samples_per_step)
        if micro == 0:
            raise UserError(f"even a micro-batch of 1 does not fit in the memory of {device}")
    return micro, accumulation_for(samples_per_step, micro)


def pad_batch(batch: dict[str, torch.Tensor], length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """A collated batch padded to ``length`` tokens: the worst case a micro-batch can be."""
    out = {}
    for key, value in batch.items():
        if value.dim() == 2 and value.shape[1] < length:
            fill = pad_token_id if key == "input_ids" else -100 if key == "labels" else 0
            extra = torch.full((value.shape[0], length - value.shape[1]), fill, dtype=value.dtype)
            value = torch.cat([value, extra], dim=1)
        out[key] = value
    return out
