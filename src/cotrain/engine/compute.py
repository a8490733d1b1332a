"""A trainer's local compute: endless micro-batches, and the forward/backward passes of one optimizer step
under mixed precision. ``cotrain train`` and the overhead benchmark's plain-PyTorch baseline both run this."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader


def batches(examples, batch_size: int, collator, seed: int = 0, num_workers: int = 0) -> Iterator[dict]:
    """Endless micro-batches. ``examples`` is an ExampleStream (endless, already in this peer's order) or
    a map-style dataset, shuffled per peer with a new order each epoch and collated by ``num_workers``
    DataLoader worker processes (0: in this process)."""
    if not hasattr(examples, "__getitem__"):
        stream = iter(examples)
        while True:
            yield collator([next(stream) for _ in range(batch_size)])
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        loader = DataLoader(
            examples,
            batch_size=batch_size,
            shuffle=True,
            collate_fn=collator,
            generator=generator,
            num_workers=num_workers,
        )
        yield from loader
        epoch += 1


def accumulate_gradients(
    model: torch.nn.Module,
    stream: Iterator[dict],
    accumulation: int,
    device: torch.device,
    precision,
    loss_fn: Callable[[torch.nn.Module, dict], torch.Tensor],
) -> float:
    """Forward and backward passes over ``accumulation`` micro-batches of ``stream`` under ``precision``
    (cotrain.host.hardware.Precision): the gradients of their mean loss end up in ``.grad``, unscaled. Returns
    that mean loss (NaN/inf when a micro-batch's loss was)."""
    step_loss = 0.0
    for _ in range(accumulation):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(stream).items()}
        with precision.autocast():
            loss = loss_fn(model, batch)
        loss = loss.float().mean() / accumulation  # DataParallel: one loss per GPU
        precision.backward(loss)
        step_loss += loss.item()
    precision.unscale(model)  # fp16: the true gradients, before clipping and before the swarm
    precision.update()
    return step_loss


def gradient_norm(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """The gradients' total norm, clipping them to ``max_norm`` when it is positive: one reduction whose
    result also says whether any gradient is NaN or infinite."""
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not params:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))


def flat_tensors(params: Iterable) -> list[torch.Tensor]:
    """Parameters given as tensors or as optimizer parameter groups, as one flat list."""
    out: list[torch.Tensor] = []
    for item in params:
        out.extend(item["params"] if isinstance(item, dict) else [item])
    return out
