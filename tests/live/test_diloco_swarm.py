"""A DiLoCo swarm of `cotrain` roles on 127.0.0.1, as one story told in order:

1. a monitor (checkpointing every round), an evaluation peer and 2 trainers run ``--strategy diloco``: the
   monitor's checkpoints hold the global parameters, the outer momentum, the inner optimizer and its schedule;
   the evaluation peer evaluates the global parameters of a round (the very weights of the monitor's
   checkpoint of that round); the checkpoint exports to a Hugging Face folder;
2. every trainer and the monitor stop; ``cotrain monitor --resume`` serves the last checkpoint, and a new
   trainer starts from it at its round with the same outer momentum and inner optimizer statistics.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    events,
    monitor_address,
    monitor_args,
    read_rows,
    trainer_args,
    trainer_rows,
    wait_until,
)
from cotrain import checkpoints as ck

pytestmark = [pytest.mark.slow]


RUN = "diloco-story"


LOCAL_STEPS = 3


# the paper's Nesterov step, which a run this short would not take by default: the test checks its momentum
OUTER = ["--outer-lr", "0.7", "--outer-momentum", "0.9"]


@pytest.fixture(scope="module")
def story(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("diloco")
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
    common += ["--strategy", "diloco", "--local-steps", str(LOCAL_STEPS), "--target-batch-size", "32", *OUTER]
    roles: dict[str, Role] = {}

    def monitor(name: str, *extra: str) -> Role:
        checkpoints = ["--dataset-path", str(demo_data), "--save-every", "1", "--load-state-timeout", "20"]
        checkpoints += ["--keep-checkpoints", "100"]  # the evaluated round stays to compare
        (out / "monitor" / "initial_peers.txt").unlink(missing_ok=True)
        roles[name] = Role(monitor_args(common, out / "monitor", *checkpoints, *extra), out / f"{name}.log")
        return roles[name]

    def trainer(name: str, initial: list[str], seed: int, *extra: str, env: dict | None = None) -> Role:
        args = trainer_args(
            common, initial, demo_data, seed, out / name, "--load-state-timeout", "30", *extra
        )
        roles[name] = Role(args, out / f"{name}.log", env=env)
        return roles[name]

    try:
        yield {"out": out, "roles": roles, "monitor": monitor, "trainer": trainer}
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.timeout(240)
def test_1_checkpoints_evaluation_and_export_hold_the_global_state(story, demo_data, tmp_path):
    out = story["out"]
    monitor = story["monitor"]("m1")
    initial = monitor_address(out / "monitor", 60)
    t1 = story["trainer"]("t1", initial, 1)
    t2 = story["trainer"]("t2", initial, 2)
    evaluator = Role(
        ["eval", "--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
        + ["--strategy", "diloco", "--local-steps", str(LOCAL_STEPS), "--target-batch-size", "32", *OUTER]
        + ["--initial-peers", *initial, "--dataset-path", str(demo_data), "--output-dir", str(out / "eval")]
        + ["--eval-every", "2", "--eval-batches", "3"],
        out / "eval.log",
        env={"COTRAIN_DEBUG_SAVE_EVALUATED": "1"},
    )
    story["roles"]["eval"] = evaluator
    root = out / "monitor" / "checkpoints"

    def newest_step() -> int:
        found = ck.latest_good(root)
        return found[1]["step"] if found else -1

    wait_until(lambda: newest_step() >= 3, 240, what="the monitor's checkpoint of round 3")
    rows = trainer_rows(t1)
    assert rows and all(r["strategy"] == "diloco" for r in rows)
    assert max(r["group_size"] for r in rows) == 2, rows
    inner = [r["inner_steps"] for r in rows]
    assert inner[0] > 0 and inner == sorted(inner) and inner[-1] > inner[0], inner
    path, meta = ck.latest_good(root)
    assert meta["config"]["run"]["strategy"] == "diloco" and meta["inner"]
    assert (path / ck.INNER_OPTIMIZER).is_file()
    # the inner schedule as the serving trainer had it: within the round after the checkpoint's
    assert (
        meta["step"] * LOCAL_STEPS
        <= meta["inner"]["scheduler"]["last_epoch"]
        <= (meta["step"] + 1) * LOCAL_STEPS
    )
    weights, outer = ck.read_tensors(path)
    momentum = [k for k in outer if k.startswith("momentum_buffer/")]
    assert momentum and any(bool(outer[k].abs().sum() > 0) for k in momentum)

    # the evaluation peer evaluated the global parameters: the weights it evaluated at a round are the
    # monitor's checkpoint of that round (both downloaded in full precision, maybe from two trainers, whose
    # global parameters agree to the fp16 rounding of the round's average when both averaged that round
    # together: a round a trainer averaged alone, as the first may be, leaves each its own)
    def shared(step: int) -> bool:
        return all(any(r["step"] == step and r["group_size"] == 2 for r in trainer_rows(t)) for t in (t1, t2))

    def both_hold() -> list:
        held = ck.list_checkpoints(out / "eval" / "evaluated")
        return [p for p in held if ck.step_dir(root, int(p.name[5:])).exists() and shared(int(p.name[5:]))]

    evaluated = wait_until(both_hold, 120, what="a round that both the monitor and the evaluation peer hold")
    step = int(evaluated[-1].name[5:])
    theirs, _ = ck.read_tensors(evaluated[-1])
    ours, _ = ck.read_tensors(ck.step_dir(root, step))
    for name, tensor in ours.items():
        torch.testing.assert_close(theirs[name], tensor, atol=1e-3, rtol=1e-3, msg=name)
    # the monitor logs the evaluations, by round
    evaluations = wait_until(
        lambda: [r for r in read_rows(out / "monitor" / "metrics.jsonl") if r.get("kind") == "eval"],
        60,
        what="the monitor to log an evaluation",
    )
    assert all(0 <= r["step"] <= newest_step() + 1 for r in evaluations), evaluations
    if len(evaluations) > 1:  # held-out loss of the global parameters falls round after round
        assert evaluations[-1]["eval_loss"] < evaluations[0]["eval_loss"], evaluations
    # export: the global parameters, as a Hugging Face folder
    from transformers import AutoModelForPreTraining

    exported = ck.export(path, tmp_path / "export")
    model = AutoModelForPreTraining.from_pretrained(str(exported))
    state = model.state_dict()
    name = next(n for n in weights if n in state)
    torch.testing.assert_close(state[name], weights[name])
    story["monitor_role"], story["trainers"] = monitor, (t1, t2)


@pytest.mark.timeout(240)
def test_2_whole_swarm_resume_restores_the_outer_momentum(story):
    out = story["out"]
    for role in (*story["trainers"], story["roles"]["eval"]):
        role.kill_all()
    story["monitor_role"].stop()
    root = out / "monitor" / "checkpoints"
    saved, meta = ck.latest_good(root)
    m2 = story["monitor"]("m2", "--resume")
    initial = monitor_address(out / "monitor", 60)
    wait_until(lambda: "Resumed from checkpoint" in m2.text(), 60, what="m2 to resume")
    t3 = story["trainer"]("t3", initial, 3, "--save-steps", "1000", env={"COTRAIN_DEBUG_SAVE_ON_START": "1"})
    start = wait_until(lambda: events(t3, "started"), 90, what="t3 to load")[0]
    assert start["loaded"] and start["step"] == meta["step"], (start, t3.text()[-3000:])
    dump = wait_until(lambda: ck.list_checkpoints(out / "t3" / "checkpoints"), 30, what="t3's dump")[0]
    weights, outer = ck.read_tensors(saved)
    got_weights, got_outer = ck.read_tensors(dump)
    for name, tensor in weights.items():
        torch.testing.assert_close(got_weights[name], tensor, msg=name)
    assert outer.keys() == got_outer.keys()
    for key, tensor in outer.items():  # the outer momentum travels uncompressed
        torch.testing.assert_close(got_outer[key], tensor, msg=key)
    inner = load_file(str(saved / ck.INNER_OPTIMIZER))
    got_inner = load_file(str(dump / ck.INNER_OPTIMIZER))
    squares = [k for k in inner if k.startswith("exp_avg_sq/")]
    assert squares
    for key in squares:
        torch.testing.assert_close(got_inner[key], inner[key], msg=key)
    t3.kill_all()
    m2.stop()
    assert m2.proc.returncode == 0 and "Traceback" not in m2.log_path.read_text()
