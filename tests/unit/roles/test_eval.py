"""The evaluation peer.

Here, in the test process alone; the rest in tests/live/test_eval.py."""

from __future__ import annotations

import math

import pytest
import torch

from cotrain.config import resolve
from cotrain.dashboard.view import SwarmView
from cotrain.net.metrics import EvalMetrics
from cotrain.roles.evaluator import evaluate
from cotrain.roles.monitor import eval_row
from support.eval import direct_loss, held_out

SMALL_MODEL = {
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


def test_fixed_batches_are_the_same_every_time(demo_data):
    _, first = held_out(demo_data)
    _, again = held_out(demo_data)
    _, other = held_out(demo_data, seed=1)
    assert len(first) == 3 and all(len(b["labels"]) == 4 for b in first)
    for a, b in zip(first, again, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, other, strict=True))


def test_more_batches_than_the_split_holds_takes_each_example_once(demo_data):
    from cotrain.data import read_manifest

    n = read_manifest(demo_data)["num_examples"]["validation"]
    _, batches = held_out(demo_data, num_batches=n + 5, batch_size=1)
    assert len(batches) == n


def test_metrics_on_fixed_batches(demo_data):
    from cotrain.models import build_model

    tokenizer, batches = held_out(demo_data)
    config = resolve(overrides={"run": {"preset": "albert-tiny", "model": SMALL_MODEL}})
    model = build_model(config.run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model.train()
    result = evaluate(model, batches, "sop+mlm")
    assert model.training, "evaluate() puts the model back in training mode"
    assert result["loss"] == pytest.approx(direct_loss(model, batches), rel=1e-6)
    # a fresh model guesses: the LM loss is about log(vocabulary), the accuracies near chance
    assert abs(result["lm_loss"] - math.log(len(tokenizer))) < 1.0
    assert result["perplexity"] == pytest.approx(math.exp(result["lm_loss"]), rel=1e-6)
    masked = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert result["tokens"] == masked and result["examples"] == 12
    assert 0 <= result["mlm_accuracy"] < 0.05 and 0 <= result["sop_accuracy"] <= 1
    record = EvalMetrics(step=0, **result)  # fits the signed record's schema
    assert record.loss == result["loss"]


def test_causal_lm_metrics_shift_the_labels():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    result = evaluate(model, [batch], "clm")
    # the model's own loss is the mean over the 3 x 15 predicted tokens: the same number, computed apart
    assert result["lm_loss"] == pytest.approx(result["loss"], rel=1e-5) and result["tokens"] == 45
    assert result["mlm_accuracy"] is None and result["sop_accuracy"] is None
    assert result["perplexity"] == pytest.approx(math.exp(result["lm_loss"]), rel=1e-6)


@pytest.mark.parametrize(
    "bad",
    [{"loss": math.nan}, {"loss": -1.0}, {"perplexity": 0.5}, {"mlm_accuracy": 1.5}, {"examples": 0}],
)
def test_out_of_bounds_evaluations_are_refused(bad):
    good = dict(step=3, loss=2.0, perplexity=5.0, lm_loss=1.6, examples=8, tokens=40)
    EvalMetrics(**good)
    with pytest.raises(ValueError):
        EvalMetrics(**{**good, **bad})


def test_the_monitor_row_and_the_dashboard_view():
    record = EvalMetrics(
        step=4, loss=2.0, perplexity=5.0, lm_loss=1.6, mlm_accuracy=0.25, examples=8, tokens=40, peer_id="p"
    )
    row = eval_row(record)
    assert row["kind"] == "eval" and row["step"] == 4 and "loss" not in row  # training-loss readers skip it
    assert row["eval_loss"] == 2.0 and row["eval_mlm_accuracy"] == 0.25 and "eval_sop_accuracy" not in row
    view = SwarmView("r", "join", 64)
    view.add_evaluation(row)
    view.add_evaluation({**row, "step": 2, "eval_loss": 3.0})  # an older state, reported late
    state = view.to_json()
    assert state["evaluation"]["step"] == 4 and state["evaluation"]["eval_loss"] == 2.0
    assert [r["step"] for r in state["evaluations"]] == [4, 2]
