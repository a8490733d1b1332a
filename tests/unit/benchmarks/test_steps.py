"""The step benchmarks (benchmarks/lib/steps.py, activations.py): arms alternating and their means, and what a
forward keeps for its backward."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO
from cotrain import config as cfg

sys.path.insert(0, str(REPO / "benchmarks"))
import activations  # noqa: E402
from lib import steps  # noqa: E402


def test_step_arms_alternate_their_order_and_report_their_means(capsys):
    order: list[str] = []

    def fake(arm: dict) -> dict:
        order.append(arm["name"])
        return {"s_per_step": arm["s"] + len(order) % 2, "rss_mib": 100.0, "peak_mib": 150.0}

    arms = {"a": {"name": "a", "s": 1.0}, "b": {"name": "b", "s": 2.0}}
    summary = steps.alternate(arms, 2, run=fake)
    assert order == ["a", "b", "b", "a"]  # the second round reversed
    both = {"rss_mib": 100, "peak_mib": 150}
    assert summary == {"a": {"s_per_step": 1.5, **both}, "b": {"s_per_step": 2.5, **both}}
    steps.print_table(summary, "a")
    out = capsys.readouterr().out
    assert "peak MiB" in out and out.splitlines()[-1].split() == ["b", "2.500", "1.67", "100", "150"]


def test_the_activations_benchmark_counts_what_a_forward_keeps_and_what_checkpointing_leaves():
    run = cfg.resolve("llama-tiny").run
    result = activations.measure("llama-tiny")
    seq, hidden = run.max_seq_length, run.model["hidden_size"]
    assert result["seq"] == seq and result["layers"] == run.model["num_hidden_layers"]
    # a checkpointed layer keeps its input alone: the hidden states of the micro-batch, in bfloat16
    assert result["checkpointing_per_layer"] == seq * hidden * 2
    assert result["full_per_layer"] > 10 * result["checkpointing_per_layer"]
    assert result["checkpointing_kept"] < result["checkpointing_peak"] < result["full_kept"]
    assert result["full_rest"] == pytest.approx(result["checkpointing_rest"], rel=0.05)  # the head's, alike
