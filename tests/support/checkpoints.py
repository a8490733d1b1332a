"""Helpers the test_checkpoints tests share across suites."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cotrain import checkpoints as ck
from cotrain.config import resolve
from cotrain.models import build_model, forward_loss
from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory

SMALL_MODEL = {
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from cotrain.data import demo_corpus, train_albert_tokenizer

    return train_albert_tokenizer(demo_corpus()[:300], 300, tmp_path_factory.mktemp("tok") / "tokenizer")


def make_config():
    return resolve(overrides={"run": {"preset": "albert-tiny", "run_id": "ck-test", "model": SMALL_MODEL}})


def fixed_batch(tokenizer, n: int = 4, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(5, len(tokenizer), (n, length), generator=g)
    labels = ids.clone()
    labels[:, ::2] = -100
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": labels,
        "sentence_order_label": torch.zeros(n, dtype=torch.long),
    }


def trained_state(tokenizer, steps: int = 3):
    """A model, LAMB optimizer and scheduler after a few real steps (nonzero moments)."""
    config = make_config()
    model = build_model(config.run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    optimizer = optimizer_factory(config.run)(parameter_groups(model, config.run.weight_decay))
    scheduler = scheduler_factory(config.run)(optimizer)
    batch = fixed_batch(tokenizer)
    for _ in range(steps):
        forward_loss(model, batch).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return config, model, optimizer, scheduler


def save(root: Path, step: int, tokenizer, state, keep: int = 3) -> Path:
    config, model, optimizer, scheduler = state
    return ck.save_checkpoint(root, step, model, optimizer, scheduler, config.to_dict(), tokenizer, keep=keep)
