"""A model's layout without its code (cotrain.host.layout).

Here, in the test process alone; the rest in tests/live/test_layout.py."""

from __future__ import annotations

import pytest
import torch

from cotrain import checkpoints as ck
from cotrain.config import resolve
from cotrain.errors import UserError
from cotrain.host.layout import LayoutModel, describe
from cotrain.models import build_model
from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory

FAMILIES = ("albert", "bert", "distilbert", "gpt2", "llama", "qwen", "roberta")


PRESETS = [f"{family}-tiny" for family in FAMILIES]


def ties(model: torch.nn.Module) -> list[list[str]]:
    """The state_dict's names grouped by the tensor they name."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return sorted(groups.values())


@pytest.mark.parametrize("preset", PRESETS)
def test_a_layout_model_has_the_models_parameters_names_order_and_ties(preset):
    run = resolve(preset).run
    real = build_model(run, vocab_size=500, pad_token_id=0)
    layout = LayoutModel(describe(real))
    assert describe(layout) == describe(real)
    assert [n for n, _ in layout.named_parameters()] == [n for n, _ in real.named_parameters()]
    assert ties(layout) == ties(real)
    assert any(len(group) > 1 for group in ties(real)) == (preset != "llama-tiny")  # a tied head
    for mine, theirs in zip(parameter_groups(layout, 0.01), parameter_groups(real, 0.01), strict=True):
        assert [p.shape for p in mine["params"]] == [p.shape for p in theirs["params"]]


def test_a_checkpoint_of_a_layout_model_loads_into_the_model_and_back(tmp_path):
    from cotrain.data import demo_corpus, train_albert_tokenizer

    tokenizer = train_albert_tokenizer(demo_corpus()[:300], 300, tmp_path / "tokenizer")
    config = resolve("albert-tiny")
    real = build_model(config.run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    layout = LayoutModel(describe(real))
    with torch.no_grad():
        for mine, theirs in zip(layout.parameters(), real.parameters(), strict=True):
            mine.copy_(theirs)
    optimizer = optimizer_factory(config.run)(parameter_groups(layout, config.run.weight_decay))
    scheduler = scheduler_factory(config.run)(optimizer)
    path = ck.save_checkpoint(tmp_path / "ck", 3, layout, optimizer, scheduler, config.to_dict(), tokenizer)
    fresh = build_model(config.run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    ck.load_into(path, fresh, optimizer_factory(config.run)(parameter_groups(fresh, config.run.weight_decay)))
    for (name, a), (_, b) in zip(real.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    again = LayoutModel(describe(real))
    ck.load_into(path, again)
    for (name, a), (_, b) in zip(real.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert again.predictions.decoder.weight is again.albert.embeddings.word_embeddings.weight


def test_a_persistent_buffer_has_no_layout():
    module = torch.nn.Linear(2, 2)
    module.register_buffer("counts", torch.zeros(2))
    with pytest.raises(UserError, match="counts is a persistent buffer"):
        describe(module)
