"""Model families: a preset's architecture -> a model, its parameter groups, optimizer and schedule."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from transformers import (
    AlbertConfig,
    AlbertForPreTraining,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from cotrain.config import RunConfig

logger = logging.getLogger(__name__)

NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight")


def build_model(run: RunConfig, vocab_size: int, pad_token_id: int = 0) -> torch.nn.Module:
    """A freshly initialised model of the run's family; the vocabulary size comes from the tokenizer."""
    if run.model_family != "albert":
        raise ValueError(f"unknown model family {run.model_family!r}")
    config = AlbertConfig(vocab_size=vocab_size, pad_token_id=pad_token_id, **run.model)
    torch.manual_seed(0)  # every peer starts from the same weights even before it loads the swarm's state
    return AlbertForPreTraining(config)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on everything but biases and LayerNorm weights, as in the seed recipe."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if any(nd in name for nd in NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_factory(run: RunConfig) -> Callable[[Iterable], torch.optim.Optimizer]:
    """A function params -> optimizer, as hivemind.Optimizer wants it."""
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
    raise ValueError(f"unknown optimizer {run.optimizer!r}")


def scheduler_factory(run: RunConfig, kind: str = "linear") -> Callable[[torch.optim.Optimizer], object]:
    """A function optimizer -> LR scheduler, stepped once per global step."""
    schedule = get_cosine_schedule_with_warmup if kind == "cosine" else get_linear_schedule_with_warmup
    return lambda opt: schedule(opt, num_warmup_steps=run.warmup_steps, num_training_steps=run.total_steps)


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The family's training loss on one collated micro-batch (ALBERT: masked LM + sentence order)."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
        labels=batch["labels"],
        sentence_order_label=batch["sentence_order_label"],
    )
    return out.loss
