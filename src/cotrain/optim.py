"""The optimizer side of a run: parameter groups, the optimizer and the learning-rate schedule.

Torch alone, no transformers: the monitor keeps the swarm's optimizer and schedule (cotrain.roles.keeper) and
imports no transformers (about 20 MB more in its process). The schedules are transformers'
``get_linear_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup``: the same ``LambdaLR`` with the
same factors (tests/test_optim.py compares them step by step), so that a schedule's state is the same wherever
it was made: in a checkpoint, in a trainer, in a monitor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from cotrain.config import RunConfig
from cotrain.errors import UserError

# no weight decay: biases and normalization weights (LayerNorm; Llama's and Qwen2's RMSNorm: *norm.weight)
NO_DECAY = (
    "bias",
    "LayerNorm.weight",
    "layer_norm.weight",
    "ln_1.weight",
    "ln_2.weight",
    "ln_f.weight",
    "norm.weight",
)


def linear_factor(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    """Linear warmup from 0, then linear decay to 0 at ``num_training_steps``."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def cosine_factor(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5
) -> float:
    """Linear warmup from 0, then a half cosine down to 0 at ``num_training_steps``."""
    if step < num_warmup_steps:
        return float(step) / float(max(1, num_warmup_steps))
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress)))


def linear_schedule(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> LambdaLR:
    factor = partial(linear_factor, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    return LambdaLR(optimizer, factor)


def cosine_schedule(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, num_training_steps: int
) -> LambdaLR:
    factor = partial(cosine_factor, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps)
    return LambdaLR(optimizer, factor)


SCHEDULES = {"linear": linear_schedule, "cosine": cosine_schedule}


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on everything but biases and normalization weights, as in the seed recipe."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if any(nd in name for nd in NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_factory(run: RunConfig) -> Callable[[Iterable], torch.optim.Optimizer]:
    """A function params -> optimizer, as hivemind.Optimizer wants it: LAMB (the seed recipe's) or AdamW."""
    if run.optimizer == "lamb":
        from torch_optimizer import Lamb

        def make(params):
            return Lamb(
                params,
                lr=run.learning_rate,
                betas=(run.adam_beta1, run.adam_beta2),
                eps=run.adam_epsilon,
                weight_decay=run.weight_decay,
                clamp_value=run.clamp_value,
                debias=True,
            )

        return make
    if run.optimizer == "adamw":
        return lambda params: torch.optim.AdamW(
            params,
            lr=run.learning_rate,
            betas=(run.adam_beta1, run.adam_beta2),
            eps=run.adam_epsilon,
            weight_decay=run.weight_decay,
        )
    raise UserError(f"unknown optimizer {run.optimizer!r}; choose lamb or adamw")


def scheduler_factory(run: RunConfig) -> Callable[[torch.optim.Optimizer], object]:
    """A function optimizer -> LR scheduler (``run.lr_scheduler``: linear or cosine decay after a linear
    warmup), which hivemind.Optimizer steps once per global step of the swarm."""
    schedule = SCHEDULES.get(run.lr_scheduler)
    if schedule is None:
        raise UserError(f"unknown lr_scheduler {run.lr_scheduler!r}; choose one of {', '.join(SCHEDULES)}")
    return lambda opt: schedule(opt, num_warmup_steps=run.warmup_steps, num_training_steps=run.total_steps)
