"""The evaluation peer.

Here, with cotrain processes; the rest in tests/unit/roles/test_eval.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
from support.eval import direct_loss, held_out

RUN = "eval-test"


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


def eval_rows(path) -> list[dict]:
    return [r for r in read_rows(path) if r.get("kind") == "eval"]


@pytest.mark.slow
@pytest.mark.timeout(240)
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
