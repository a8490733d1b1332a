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
@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_two_client_trainers_average_through_the_monitor(strategy, demo_data, tmp_path):
    """Two trainers in client mode and no other full peer: only a public monitor can reduce their parts. With
    sync they are given --client-mode, and the first monitor reduces nothing (--no-reduce): a second monitor,
    a public machine with no dataset (a tokenizer only) and no checkpoints, reduces for them. With diloco no
    flag: the dial-back probe finds the trainers unreachable (a closed port stands for their NAT), so they
    join as clients by themselves, and the first monitor reduces."""
    common = ["--preset", "albert-tiny", "--run-id", f"aux-{strategy}", "--host-maddrs", LOCALHOST, *FAST]
    common += ["--strategy", strategy]
    if strategy == "diloco":  # sparse rounds: the reducer decodes, averages and re-encodes the records
        common += ["--local-steps", "2", "--outer-compression", "topk"]
    steps = 6 if strategy == "sync" else 4  # sync: a loaded machine may start one trainer two steps late
    first = ["--dataset-path", str(demo_data), "--save-every", "0"]
    first += ["--no-reduce"] if strategy == "sync" else []
    monitor = Role(monitor_args(common, tmp_path / "monitor", *first), tmp_path / "monitor.log")
    roles = [monitor]
    try:
        initial = monitor_address(tmp_path / "monitor", 90)
        reducer = monitor
        if strategy == "sync":  # a second public machine: no dataset, no checkpoints, no dashboard
            args = ["--initial-peers", *initial, "--tokenizer-path", str(demo_data / "tokenizer")]
            reducer = Role(
                monitor_args(common, tmp_path / "second", *args, "--save-every", "0"), tmp_path / "second.log"
            )
            roles.append(reducer)
            monitor_address(tmp_path / "second", 90, what="the second monitor's address")
        flag, env = (
            (["--client-mode"], None) if strategy == "sync" else ([], {"COTRAIN_DEBUG_UNREACHABLE": "1"})
        )
        for i in range(2):
            args = trainer_args(common, initial, demo_data, i + 1, tmp_path / f"t{i}", *flag)
            roles.append(Role([*args, "--max-steps", "100"], tmp_path / f"trainer{i}.log", env=env))
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
        if strategy == "diloco":  # a second monitor that nobody can dial could reduce nothing: it refuses
            second = tmp_path / "second"
            args = monitor_args(common, second, "--initial-peers", *initial, "--dataset-path", str(demo_data))
            refused = Role(args, tmp_path / "second.log", env={"COTRAIN_DEBUG_UNREACHABLE": "1"})
            assert refused.proc.wait(timeout=120) != 0
            lines = [line for line in refused.text().splitlines() if line.strip()]
            assert "cannot dial this monitor" in lines[-1] and "--no-reduce" in lines[-1], lines
            assert not (second / "initial_peers.txt").exists() and "Traceback" not in refused.text()
    finally:
        for role in roles:
            role.stop()
    text = reducer.log_path.read_text()
    assert "Reducing the trainers'" in text and "as an auxiliary peer" in text, text[-3000:]
    reduced = int(text.split("Reduced ", 1)[1].split()[0])  # its last line: rounds it took part in
    if strategy == "sync":
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
        log = trainer.log_path.read_text()
        assert "Traceback" not in log
        if strategy == "diloco":  # it found out by itself, and said so in one line
            assert "could not reach it at /ip4/127.0.0.1/tcp/1" in log and "joining as a client" in log, log
    assert "Traceback" not in text


@pytest.mark.slow
@pytest.mark.alone  # four peers of sparse rounds: under another live test's load, clients' rounds rarely meet
@pytest.mark.timeout(240)
def test_a_client_claiming_a_huge_weight_is_refused_and_the_honest_ones_keep_averaging(demo_data, tmp_path):
    """Sparse rounds through the monitor, the only public peer, with two honest clients and one that sends
    its parts with weight 1e39 every round (finite as a double, Inf in float32: it once made the monitor's
    average NaN and its carried residue NaN for every later group). The monitor refuses that sender and
    strikes it (one line each; excluded at the third), nobody else; the honest clients' rounds through it
    stay finite and keep averaging."""
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
            grouped = max(sum(r["group_size"] >= 2 for r in rs) for rs in rows) >= 2
            return struck and grouped and all(len(rs) >= steps for rs in rows)

        wait_until(seen, 200, what="a strike by the monitor and the honest clients' steps")
        for trainer in honest:
            assert trainer.proc.poll() is None, trainer.text()[-3000:]  # still training beside the attacker
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
    assert int(text.split("Reduced ", 1)[1].split()[0]) >= 2, text[-3000:]  # rounds it reduced
    rows = [trainer_rows(t) for t in honest]
    # the honest clients averaged through the monitor (a slow one may have stepped alone: rounds do not
    # wait for a peer, and the attacker's samples count toward them until it is excluded)
    assert max(sum(r["group_size"] >= 2 for r in rs) for rs in rows) >= 2, rows
    for trainer, rs in zip(honest, rows, strict=True):
        log = trainer.log_path.read_text()
        assert "non-finite average" not in log and "Traceback" not in log, log[-3000:]
        assert all(math.isfinite(r["loss"]) for r in rs) and rs[-1]["loss"] < rs[0]["loss"], rs
        assert rs[-1]["step"] >= steps, rs
