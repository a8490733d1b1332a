"""The optimizer side of a run: parameter groups, the optimizer and the learning-rate schedule.

Torch alone, no transformers: the monitor keeps the swarm's optimizer and schedule (cotrain.roles.keeper) and
imports no transformers (about 20 MB more in its process). The schedules are transformers'
``get_linear_schedule_with_warmup`` and ``get_cosine_schedule_with_warmup``: the same ``LambdaLR`` with the
same factors (tests/unit/test_optim.py compares them step by step), so that a schedule's state is the same
wherever it was made: in a checkpoint, in a trainer, in a monitor.

LAMB (the seed recipe's optimizer) is cotrain's own ``Lamb``: the algorithm of ``torch_optimizer.Lamb``
(You et al., "Large Batch Optimization for Deep Learning", with Adam's bias correction), the same updates and
the same state entries, so that checkpoints and the swarm's averaged optimizer state carry over
(tests/unit/test_optim.py compares the two step by step where torch-optimizer is installed).
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


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam's step, with weight decay added to it, scaled per tensor by the trust ratio
    ||w|| / ||step|| (||w|| clamped at ``clamp_value``; 1 where either norm is 0). Adam's bias correction is
    applied to the learning rate."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_value: float = 10.0,
    ) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0 or not clamp_value >= 0.0:
            raise ValueError(f"LAMB: lr, eps, weight_decay and clamp_value must be >= 0 ({lr}, {eps}, ...)")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"LAMB: betas must lie in [0, 1), got {betas}")
        self.clamp_value = clamp_value
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                weight_norm = torch.norm(p).clamp(0, self.clamp_value)
                adam_step = exp_avg / exp_avg_sq.sqrt().add(group["eps"])
                if group["weight_decay"] != 0:
                    adam_step.add_(p, alpha=group["weight_decay"])
                adam_norm = torch.norm(adam_step)
                trust_ratio = 1 if weight_norm == 0 or adam_norm == 0 else weight_norm / adam_norm
                state.update(weight_norm=weight_norm, adam_norm=adam_norm, trust_ratio=trust_ratio)
                p.add_(adam_step, alpha=-step_size * trust_ratio)
        return loss


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on everything but biases and normalization weights, as in the seed recipe."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if any(nd in name for nd in NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_factory(run: RunConfig) -> Callable[[Iterable], torch.optim.Optimizer]:
    """A function params -> optimizer, as hivemind.Optimizer wants it: LAMB (the seed recipe's) or AdamW."""
    if run.optimizer == "lamb":

        def make(params):
            return Lamb(
                params,
                lr=run.learning_rate,
                betas=(run.adam_beta1, run.adam_beta2),
                eps=run.adam_epsilon,
                weight_decay=run.weight_decay,
                clamp_value=run.clamp_value,
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
