"""The monitor as an auxiliary reducer.

Here, with cotrain processes; the rest in tests/swarm/test_auxiliary.py and
tests/unit/hivemind_ext/test_auxiliary.py."""

from __future__ import annotations

import math
import signal

import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    events,
    monitor_address,
    monitor_args,
    trainer_args,
    trainer_rows,
    wait_until,
)


def steps_together(trainers: list[Role]) -> set[int]:
    """The steps that both trainers logged as averaged in a group of two."""
    together = [{r["step"] for r in trainer_rows(t) if r["group_size"] == 2} for t in trainers]
    return together[0] & together[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_client_trainers_average_through_a_second_monitor(demo_data, tmp_path):
    """Two sync trainers given --client-mode and no other full peer: only a public monitor can reduce their
    parts. The first monitor reduces nothing (--no-reduce): a second monitor, a public machine with no dataset
    (a tokenizer only) and no checkpoints, reduces for them. (DiLoCo clients that find out by themselves:
    the huge-weight test below.)"""
    common = ["--preset", "albert-tiny", "--run-id", "aux-sync", "--host-maddrs", LOCALHOST, *FAST]
    steps = 6  # a loaded machine may start one trainer two steps late
    first = ["--dataset-path", str(demo_data), "--save-every", "0", "--no-reduce"]
    monitor = Role(monitor_args(common, tmp_path / "monitor", *first), tmp_path / "monitor.log")
    roles = [monitor]
    try:
        initial = monitor_address(tmp_path / "monitor", 90)
        # a second public machine: no dataset, no checkpoints, no dashboard
        args = ["--initial-peers", *initial, "--tokenizer-path", str(demo_data / "tokenizer")]
        reducer = Role(
            monitor_args(common, tmp_path / "second", *args, "--save-every", "0"), tmp_path / "second.log"
        )
        roles.append(reducer)
        monitor_address(tmp_path / "second", 90, what="the second monitor's address")
        for i in range(2):
            args = trainer_args(common, initial, demo_data, i + 1, tmp_path / f"t{i}", "--client-mode")
            roles.append(Role([*args, "--max-steps", "100"], tmp_path / f"trainer{i}.log"))
        trainers = roles[-2:]
        # the event, not a count of steps: a trainer that starts its first round late may step alone for a
        # few rounds before the two meet (a round does not wait for a peer)
        wait_until(
            lambda: (
                len(steps_together(trainers)) >= 2 and all(len(trainer_rows(t)) >= steps for t in trainers)
            ),
            200,
            what="two steps the clients averaged together through the monitor",
        )
        for trainer in trainers:
            trainer.proc.send_signal(signal.SIGTERM)
        for trainer in trainers:
            assert trainer.proc.wait(timeout=60) == 0, trainer.text()[-3000:]
    finally:
        for role in roles:
            role.stop()
    text = reducer.log_path.read_text()
    assert "Reducing the trainers'" in text and "as an auxiliary peer" in text, text[-3000:]
    reduced = int(text.split("Reduced ", 1)[1].split()[0])  # its last line: rounds it took part in
    first_text = monitor.log_path.read_text()
    assert "Not reducing for client-mode trainers (--no-reduce)" in first_text, first_text[-3000:]
    assert "Reduced " not in first_text and "Traceback" not in first_text
    assert "Checkpoints are off" in text  # the second machine only reduces (and logs the swarm)
    rows = [trainer_rows(t) for t in trainers]
    # clients cannot reduce for each other: every step they averaged together went through the monitor,
    # which counts for no one in the group's size
    together = steps_together(trainers)
    assert len(together) >= 2, rows
    assert reduced >= len(together), text[-3000:]
    assert all(r["group_size"] <= 2 for rs in rows for r in rs), rows
    for rs in rows:
        assert rs[-1]["step"] >= steps and rs[-1]["loss"] < rs[0]["loss"], rs
    for trainer in trainers:
        assert "Traceback" not in trainer.log_path.read_text()
    assert "Traceback" not in text


def grouped(rows: list[list[dict]]) -> int:
    """The most steps that one of the trainers whose ``rows`` these are averaged in a group."""
    return max(sum(r["group_size"] >= 2 for r in rs) for rs in rows)


@pytest.mark.slow
@pytest.mark.alone  # four peers of sparse rounds: under another live test's load, clients' rounds rarely meet
@pytest.mark.timeout(240)
def test_unreachable_clients_average_through_the_monitor_which_refuses_a_huge_weight(demo_data, tmp_path):
    """Sparse DiLoCo rounds through the monitor, the only public peer (it decodes, averages and re-encodes
    the records), with three trainers given no flag: the dial-back probe finds them unreachable (a closed
    port stands for their NAT), so they join as clients by themselves. Two are honest; one sends its parts
    with weight 1e39 every round (finite as a double, Inf in float32: it once made the monitor's average NaN
    and its carried residue NaN for every later group). The monitor refuses that sender and strikes it (one
    line each; excluded at the third), nobody else; the honest clients average through it, their
    rounds stay finite, and they stop on SIGTERM with exit 0. A second monitor that nobody can dial could
    reduce nothing: it refuses to start."""
    common = ["--preset", "albert-tiny", "--run-id", "aux-weight", "--host-maddrs", LOCALHOST, *FAST]
    common += ["--strategy", "diloco", "--local-steps", "2", "--outer-compression", "topk"]
    steps = 5
    monitor = Role(
        monitor_args(common, tmp_path / "monitor", "--dataset-path", str(demo_data), "--save-every", "0"),
        tmp_path / "monitor.log",
    )
    roles = [monitor]
    unreachable = {"COTRAIN_DEBUG_UNREACHABLE": "1"}
    attack = {**unreachable, "COTRAIN_ATTACK": "huge-weight", "COTRAIN_ATTACK_SCALE": "1e39"}
    try:
        initial = monitor_address(tmp_path / "monitor", 90)
        for i, env in enumerate([unreachable, unreachable, attack]):
            args = trainer_args(common, initial, demo_data, i + 1, tmp_path / f"t{i}")
            roles.append(Role([*args, "--max-steps", "100"], tmp_path / f"trainer{i}.log", env=env))
        honest, attacker = roles[1:3], roles[3]

        def seen() -> bool:  # the monitor struck a sender; the honest clients took their steps, in groups
            struck = "(strike " in monitor.log_path.read_text()
            rows = [trainer_rows(t) for t in honest]
            return struck and grouped(rows) >= 2 and all(len(rs) >= steps for rs in rows)

        wait_until(seen, 200, what="a strike by the monitor and the honest clients' steps in groups")
        for trainer in honest:
            assert trainer.proc.poll() is None, trainer.text()[-3000:]  # still training beside the attacker
            trainer.proc.send_signal(signal.SIGTERM)
        for trainer in honest:
            assert trainer.proc.wait(timeout=60) == 0, trainer.text()[-3000:]
        second = tmp_path / "second"
        args = monitor_args(common, second, "--initial-peers", *initial, "--dataset-path", str(demo_data))
        refused = Role(args, tmp_path / "second.log", env=unreachable)
        roles.append(refused)
        assert refused.proc.wait(timeout=120) != 0
        lines = [line for line in refused.text().splitlines() if line.strip()]
        assert "cannot dial this monitor" in lines[-1] and "--no-reduce" in lines[-1], lines
        assert not (second / "initial_peers.txt").exists() and "Traceback" not in refused.text()
    finally:
        for role in reversed(roles):  # the trainers, then the monitor that reduces for them
            role.stop()
    text = monitor.log_path.read_text()
    joined = events(attacker, "joined")
    attacker_id = joined[0]["peer_id"] if joined else ""
    assert "Reducing the trainers'" in text and "Traceback" not in text, text[-3000:]
    # refused and struck by the monitor in every all-reduce they met in (excluded at the third, one line)
    strikes = [line for line in text.splitlines() if "(strike " in line]
    assert attacker_id and strikes, text[-4000:]
    assert all(f"from peer {attacker_id} refused" in s for s in strikes), strikes
    rows = [trainer_rows(t) for t in honest]
    # the honest clients averaged through the monitor (a slow one may step alone for a while: rounds do not
    # wait for a peer, and the attacker's samples count toward them until it is excluded)
    assert int(text.split("Reduced ", 1)[1].split()[0]) >= grouped(rows) >= 2, text[-3000:]  # rounds reduced
    # clients cannot reduce for each other: the monitor, which counts for no one in a group's size, did
    assert all(r["group_size"] <= 3 for rs in rows for r in rs), rows
    for trainer, rs in zip(honest, rows, strict=True):
        log = trainer.log_path.read_text()
        assert "non-finite average" not in log and "Traceback" not in log, log[-3000:]
        # it found out by itself that nobody can dial it, and said so in one line
        assert "could not reach it at /ip4/127.0.0.1/tcp/1" in log and "joining as a client" in log, log
        assert all(math.isfinite(r["loss"]) for r in rs) and rs[-1]["loss"] < rs[0]["loss"], rs
        assert rs[-1]["step"] >= steps, rs
