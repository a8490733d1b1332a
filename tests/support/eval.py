"""Helpers the test_eval tests share across suites."""

from __future__ import annotations

import torch

from cotrain.roles.evaluator import fixed_batches


def held_out(demo_data, seed: int = 0, num_batches: int = 3, batch_size: int = 4):
    from cotrain.data import ExampleStream, collator_for

    with ExampleStream(demo_data, seed=seed, split="validation") as data:
        collator = collator_for("sop+mlm", data.tokenizer, seed=seed)
        return data.tokenizer, fixed_batches(data, collator, num_batches, batch_size)


def direct_loss(model: torch.nn.Module, batches: list[dict]) -> float:
    """The model's own loss, batch by batch, as a training step computes it (in eval mode)."""
    model.eval()
    with torch.no_grad():
        return sum(float(model(**b).loss) for b in batches) / len(batches)
