"""Redundant first peers on 127.0.0.1, as one story told in order (each test checks one chapter):

1. monitor A starts; monitor B joins it; two trainers start with both addresses (``--initial-peers A B``):
   both monitors log the swarm's metrics and keep checkpoints of its state;
2. A dies (SIGKILL of its whole process tree): the trainers keep taking global steps and B keeps logging them;
3. a third trainer given only B's address joins, loads the swarm's state and averages with the others;
4. a client given both addresses, the dead one first, still reads the swarm's state.
"""

from __future__ import annotations

import json

import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    alive,
    events,
    monitor_address,
    monitor_args,
    read_rows,
    trainer_args,
    trainer_rows,
    wait_until,
)

pytestmark = [pytest.mark.slow]


RUN = "monitors-test"


def top(role: Role) -> int:
    return max((r["step"] for r in trainer_rows(role)), default=-1)


def last_step(path) -> int:
    return max((r["step"] for r in read_rows(path)), default=-1)


@pytest.fixture(scope="module")
def story(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("monitors")
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
    roles: dict[str, Role] = {}

    def monitor(name: str, *extra: str) -> list[str]:
        checkpoints = ["--dataset-path", str(demo_data), "--save-every", "3", "--load-state-timeout", "20"]
        roles[name] = Role(monitor_args(common, out / name, *checkpoints, *extra), out / f"{name}.log")
        return monitor_address(out / name, 240, what=f"{name}'s address")

    def trainer(name: str, initial: list[str], seed: int) -> Role:
        timeouts = ["--statistics-expiration", "60", "--load-state-timeout", "30"]
        roles[name] = Role(
            trainer_args(common, initial, demo_data, seed, out / name, *timeouts), out / f"{name}.log"
        )
        return roles[name]

    try:
        a = monitor("monitor_a")
        b = monitor("monitor_b", "--initial-peers", *a)
        trainer("trainer0", a + b, 1)
        trainer("trainer1", a + b, 2)
        yield {"out": out, "roles": roles, "a": a, "b": b, "trainer": trainer}
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.timeout(240)
def test_both_monitors_log_the_swarm_and_keep_checkpoints(story):
    out = story["out"]

    def both_see_two_trainers():
        return all(
            any(r["alive_peers"] == 2 and r["step"] >= 4 for r in read_rows(out / m / "metrics.jsonl"))
            for m in ("monitor_a", "monitor_b")
        )

    wait_until(both_see_two_trainers, 600, what="both monitors to log 2 trainers past step 4")
    for m in ("monitor_a", "monitor_b"):
        wait_until(
            lambda m=m: list((out / m / "checkpoints").glob("step-*")),
            120,
            what=f"a checkpoint from {m}",
        )


@pytest.mark.timeout(240)
def test_trainers_keep_training_after_the_first_monitor_dies(story):
    out, roles = story["out"], story["roles"]
    pids = roles["monitor_a"].tree()
    roles["monitor_a"].kill_all()  # SIGKILL of the supervisor, its worker and hivemind's processes
    wait_until(lambda: not alive(pids), 15, what="monitor A's processes to die")
    at_kill = {name: top(roles[name]) for name in ("trainer0", "trainer1")}
    logged = last_step(out / "monitor_b" / "metrics.jsonl")
    wait_until(
        lambda: all(top(roles[name]) >= at_kill[name] + 2 for name in at_kill),
        240,
        what="both trainers to take 2 more global steps",
    )
    wait_until(
        lambda: last_step(out / "monitor_b" / "metrics.jsonl") >= logged + 2,
        60,
        what="monitor B to log the new steps",
    )
    for name in ("trainer0", "trainer1"):
        assert roles[name].proc.poll() is None, roles[name].text()[-2000:]


@pytest.mark.timeout(240)
def test_a_trainer_joins_through_the_surviving_monitor(story):
    out, roles = story["out"], story["roles"]
    swarm_step = last_step(out / "monitor_b" / "metrics.jsonl")
    late = story["trainer"]("trainer2", story["b"], 3)
    started = wait_until(
        lambda: events(late, "started"), 360, what="the third trainer to load the swarm's state"
    )[0]
    assert started["loaded"], (started, late.text()[-3000:])
    start = started["step"]
    assert start >= swarm_step - 1, started
    steps = wait_until(
        lambda: [r["step"] for r in trainer_rows(late) if r["group_size"] >= 2],
        180,
        what="the third trainer to average with another peer",
    )
    assert steps[0] > start, (start, steps)

    def shared_steps() -> set[int]:  # the others write a step's row as they finish it: read until they have
        others = {r["step"] for name in ("trainer0", "trainer1") for r in trainer_rows(roles[name])}
        return {r["step"] for r in trainer_rows(late)} & others

    wait_until(shared_steps, 60, what="a step of the third trainer's in the other trainers' rows")
    wait_until(
        lambda: any(r["alive_peers"] == 3 for r in read_rows(out / "monitor_b" / "metrics.jsonl")),
        120,
        what="monitor B to count 3 trainers",
    )


@pytest.mark.timeout(240)
def test_a_dead_first_initial_peer_is_skipped(story, tmp_path):
    role = Role(
        [
            "status",
            "--preset",
            "albert-tiny",
            "--run-id",
            RUN,
            "--initial-peers",
            *story["a"],
            *story["b"],
            "--host-maddrs",
            LOCALHOST,
            "--json",
        ],
        tmp_path / "status.log",
    )
    role.proc.wait(timeout=200)
    text = role.text()
    assert role.proc.returncode == 0, text
    state = json.loads(text.strip().splitlines()[-1])
    assert state["run_id"] == RUN and state["num_peers"] >= 2, state


def test_no_traceback_in_logs(story):
    for name, role in story["roles"].items():
        assert "Traceback" not in role.log_path.read_text(errors="replace"), name  # stopped roles included
