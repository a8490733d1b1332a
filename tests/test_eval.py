"""The evaluation peer.

Fast: the metrics on fixed batches (what they are, that the batches and masks are the same every time), the
signed record's bounds, the monitor's JSONL row and dashboard view, the command line.

Slow, one swarm on 127.0.0.1: a monitor, two albert-tiny trainers and `cotrain eval`. The eval peer's numbers
are those of the very state it loaded (recomputed here from the weights it saved), they improve as the swarm
trains, and the monitor logs them beside the training metrics.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    alive,
    cotrain_env,
    monitor_address,
    monitor_args,
    read_rows,
    wait_until,
)
from cotrain.config import resolve
from cotrain.dashboard.view import SwarmView
from cotrain.net.metrics import EvalMetrics
from cotrain.roles.evaluator import evaluate, fixed_batches
from cotrain.roles.monitor import eval_row

RUN = "eval-test"
SMALL_MODEL = {
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


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


def test_eval_command_line(tmp_path):
    from cotrain import cli
    from cotrain.config import ConfigError

    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["eval"]
    for flag in (
        "--eval-every",
        "--eval-batches",
        "--per-device-eval-batch-size",
        "--per_device_eval_batch_size",
    ):
        assert flag in sub._option_string_actions
    with pytest.raises(ConfigError, match="eval_every must be positive"):
        cli.parse(["eval", "--eval-every", "0"])
    bad = subprocess.run(
        [sys.executable, "-m", "cotrain", "eval", "--host-maddrs", LOCALHOST, "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cotrain_env(),
        timeout=120,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "--dataset-path" in bad.stderr.strip().splitlines()[-1]


# --- a live swarm with an evaluation peer ---------------------------------------------------------------


def eval_rows(path) -> list[dict]:
    return [r for r in read_rows(path) if r.get("kind") == "eval"]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_an_eval_peer_measures_the_swarms_state(demo_data, tmp_path):
    from cotrain import checkpoints as ck
    from cotrain.data import read_manifest

    # a higher learning rate and a smaller target batch than the preset's: a clear fall in a few quick steps
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
    common += ["--learning-rate", "0.06", "--warmup-steps", "0", "--target-batch-size", "32"]
    metrics = tmp_path / "monitor" / "metrics.jsonl"
    roles: list[Role] = []
    try:
        roles.append(
            Role(monitor_args(common, tmp_path / "monitor", "--save-every", "0"), tmp_path / "monitor.log")
        )
        initial = monitor_address(tmp_path / "monitor", 120)
        for seed in (1, 2):
            roles.append(
                Role(
                    ["train", *common, "--initial-peers", *initial, "--dataset-path", str(demo_data)]
                    + ["--seed", str(seed), "--output-dir", str(tmp_path / f"t{seed}"), "--save-steps", "0"],
                    tmp_path / f"t{seed}.log",
                )
            )
        evaluator = Role(
            ["eval", *common, "--initial-peers", *initial, "--dataset-path", str(demo_data)]
            + ["--output-dir", str(tmp_path / "eval"), "--eval-every", "3", "--eval-batches", "5"]
            + ["--per-device-eval-batch-size", "4", "--load-state-timeout", "20"],
            tmp_path / "eval.log",
            env={"COTRAIN_DEBUG_SAVE_EVALUATED": "1"},
        )
        roles.append(evaluator)

        def progressed() -> bool:  # and both trainers counted by the monitor (one may start late when busy)
            steps = [r["step"] for r in eval_rows(metrics)]
            both = any(r.get("alive_peers") == 2 for r in read_rows(metrics) if "kind" not in r)
            return both and len(steps) >= 3 and max(steps) >= min(steps) + 3

        wait_until(progressed, 360, interval=1, what="evaluations 3 steps apart and both trainers counted")
        for role in roles:
            assert role.proc.poll() is None, role.text()
        # `cotrain status` reads the evaluation records itself
        status = Role(
            ["status", "--run-id", RUN, "--initial-peers", *initial, "--host-maddrs", LOCALHOST, "--json"],
            tmp_path / "status.log",
        )
        status.proc.wait(timeout=90)
        assert status.proc.returncode == 0, status.text()
        evaluations = json.loads(status.text().strip().splitlines()[-1])["evaluations"]
        assert len(evaluations) == 1 and evaluations[0]["step"] >= min(r["step"] for r in eval_rows(metrics))
        assert evaluations[0]["peer_id"] in evaluator.text() and evaluations[0]["loss"] > 0
        tree = evaluator.tree()  # its worker, DHT, p2pd and averager processes
        evaluator.stop()
        assert evaluator.proc.returncode == 0, (tmp_path / "eval.log").read_text()[-3000:]
        wait_until(lambda: not alive(tree), 15, what="the eval peer's processes to end")
    finally:
        for role in roles:
            role.stop()

    rows = eval_rows(metrics)
    expected = min(20, read_manifest(demo_data)["num_examples"]["validation"])  # 5 batches of 4 at most
    assert len({r["step"] for r in rows}) == len(rows), "each evaluated state is logged once"
    first, last = rows[0], rows[-1]
    for row in rows:
        assert 0 <= row["eval_mlm_accuracy"] <= 1 and 0 <= row["eval_sop_accuracy"] <= 1
        assert row["eval_examples"] == expected and row["eval_perplexity"] >= 1
    assert last["eval_loss"] < first["eval_loss"] - 0.05, rows
    assert last["eval_perplexity"] < 0.9 * first["eval_perplexity"], rows

    # the numbers are those of the state it evaluated: recompute them from the weights it saved
    _, batches = held_out(demo_data, seed=0, num_batches=5, batch_size=4)
    for row in (first, last):
        path = ck.step_dir(tmp_path / "eval" / "evaluated", row["step"])
        model, _ = ck.build_from_checkpoint(path, ck.verify(path))
        assert direct_loss(model, batches) == pytest.approx(row["eval_loss"], rel=1e-4, abs=1e-5)
    # the training rows are there beside them, and the eval peer is no trainer: two peers report training
    training = [r for r in read_rows(metrics) if "kind" not in r]
    assert training and max(r["alive_peers"] for r in training) == 2
    log = (tmp_path / "eval.log").read_text()
    assert "eval step" in log and "Traceback" not in log
