"""`cotrain demo` end to end, as a new user runs it, and interrupted with Ctrl+C."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import Role, alive, monitor_address, wait_until

pytestmark = [pytest.mark.slow]


def _stop_the_demo(role: Role, how: str, started: float) -> None:
    """Stop a running demo as a user does: Ctrl+C in a terminal (SIGINT to the whole process group), or
    SIGTERM to the demo's process alone (`kill PID`, a service manager). Every peer of the demo stops with it
    within 15 s, and nothing is left behind: no process, no file in /dev/shm."""
    pids = role.tree()
    assert len(pids) >= 9, pids  # demo, 3 supervisors, 3 workers, their DHT processes and daemons
    commands = {}  # pid -> its command line, to name the process of any file left in /dev/shm
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            commands[pid] = " ".join(psutil.Process(pid).cmdline()[-3:]) or psutil.Process(pid).name()
    assert not any("torch_shm_manager" in c for c in commands.values()), commands  # shared by descriptors
    # each role's worker has two malloc arenas (cotrain.host.procs.worker_env), as the user's environment had
    # none
    arenas = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if "cotrain._worker" in proc.cmdline():
                arenas[pid] = proc.environ().get("MALLOC_ARENA_MAX")
    assert list(arenas.values()) == [os.environ.get("MALLOC_ARENA_MAX", "2")] * 3, (arenas, commands)
    t = time.monotonic()
    if how == "ctrl-c":
        role.signal_group(signal.SIGINT)
    else:
        role.proc.send_signal(signal.SIGTERM)
    role.proc.wait(timeout=15)
    while alive(pids) and time.monotonic() - t < 15:
        time.sleep(0.25)
    assert not alive(pids), f"left behind after {how}: {alive(pids)}"
    # nor files in /dev/shm (one of an earlier run, by a process whose pid is reused here, is not the demo's)
    left = {
        f: commands.get(pid)
        for pid in pids
        for f in glob.glob(f"/dev/shm/torch_{pid}_*")
        if os.stat(f).st_mtime >= started
    }
    assert not left, left
    text = role.text()
    assert "Traceback" not in text
    if how == "sigterm":
        assert role.proc.returncode == 128 + signal.SIGTERM and "SIGTERM: stopping the swarm" in text, text
    else:  # also where the shell that started the demo ignored SIGINT (a background job of a script)
        assert role.proc.returncode == 128 + signal.SIGINT and "interrupted: stopping the swarm" in text, text


@pytest.mark.timeout(240)
def test_the_diloco_demo_averages_outer_rounds_reports_its_strategy_and_stops_on_sigterm(tmp_path):
    """`cotrain demo --strategy diloco`: without --local-steps the demo's rounds are 5 x 64 samples (not
    50 x 64); the two trainers average their parameter changes in groups of 2 and the loss falls. The
    monitor's rows carry the strategy, the inner steps (5 per round) and the bytes each peer sent. After four
    rounds the demo gets SIGTERM, and the whole swarm stops with it."""
    from conftest import read_rows
    from cotrain.demo import summarize

    started = time.time()
    args = ["demo", "--strategy", "diloco", "--steps", "1000", "--output-dir", str(tmp_path)]
    role = Role([*args, "--dashboard-port", "-1"], tmp_path / "demo.log")
    try:
        # while it trains: `cotrain status` given a preset still shows the swarm's strategy and its rounds
        wait_until(lambda: "outer round 1: loss" in role.text(), 400, what="the demo's first outer round")
        monitor = monitor_address(tmp_path / "demo" / "monitor", 10)
        args = ["status", "--preset", "albert-tiny", "--json", "--initial-peers", *monitor]
        status = subprocess.run(
            [sys.executable, "-m", "cotrain", *args], capture_output=True, text=True, timeout=120
        )
        wait_until(lambda: "outer round 4: loss" in role.text(), 400, what="the demo's fourth outer round")
        _stop_the_demo(role, "sigterm", started)
        text = role.text()
    finally:
        role.stop()
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert (state["strategy"], state["local_steps"], state["step_samples"]) == ("diloco", 5, 320), state
    assert state["global_step"] >= 1 and state["num_peers"] == 2, state
    assert "--local-steps 5 (the demo's" in text and "outer round 1: loss" in text
    root = tmp_path / "demo"
    rows = [r for r in read_rows(root / "monitor" / "metrics.jsonl") if r.get("loss") is not None]
    summary = summarize(rows, peers=2, seconds=1.0, strategy="diloco")
    assert summary["global_steps"] >= 4 and summary["max_group_size"] >= 2, rows
    assert summary["loss_last"] < summary["loss_first"], rows
    assert {r["strategy"] for r in rows} == {"diloco"}
    averaged = [r for r in rows if r["max_group_size"] >= 2]
    assert averaged and all(r["round_bytes"] > 0 and r["inner_steps"] >= 5 for r in averaged), rows
    for name in ("trainer0", "trainer1"):
        trained = read_rows(root / name / "metrics.jsonl")
        assert trained and {r["strategy"] for r in trained} == {"diloco"}, name
        inner = [r["inner_steps"] for r in trained]
        assert inner == sorted(inner) and inner[-1] >= 5 * trained[-1]["step"], trained
    for name in ("monitor", "trainer0", "trainer1"):
        assert "Traceback" not in (root / f"{name}.log").read_text(), name


@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_whole_demo_within_15_seconds(tmp_path):
    """Ctrl+C in a terminal while the demo trains: every peer stops with it, nothing is left behind (SIGTERM
    is the DiLoCo demo's test)."""
    started = time.time()
    role = Role(
        ["demo", "--peers", "2", "--steps", "1000", "--output-dir", str(tmp_path)], tmp_path / "demo.log"
    )
    try:
        wait_until(lambda: "[demo] global step " in role.text(), 240, what="the demo's first global step")
        _stop_the_demo(role, "ctrl-c", started)
    finally:
        role.stop()


@pytest.mark.timeout(240)
def test_demo_trains_a_real_swarm_reports_and_gives_every_peer_its_run_flags(tmp_path):
    """`cotrain demo` as a new user runs it (its dashboard on), with `--weight-decay 0.3 --target-batch-size
    32`: the two trainers average and the loss falls; the last line is the demo's summary; each peer's
    resolved config (its OUTPUT_DIR/config.toml) shows both flags, and the swarm's steps are 32 samples, not
    albert-tiny's 64."""
    import tomllib

    from conftest import read_rows

    args = ["demo", "--peers", "2", "--steps", "6", "--output-dir", str(tmp_path)]
    role = Role([*args, "--weight-decay", "0.3", "--target-batch-size", "32", "--matchmaking-time", "1.5"],
                tmp_path / "demo.log")  # fmt: skip
    try:
        role.proc.wait(timeout=560)
    finally:
        role.stop()
    text = role.log_path.read_text(errors="replace")
    assert role.proc.returncode == 0, text[-3000:]
    summary = json.loads(
        [line for line in text.splitlines() if line.startswith('{"event": "demo_summary"')][-1]
    )
    assert summary["strategy"] == "sync"
    assert summary["peers"] == 2 and summary["global_steps"] >= 4
    assert summary["max_group_size"] >= 2
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["samples"] > 0 and summary["seconds"] > 0
    assert "Traceback" not in text
    root = tmp_path / "demo"
    for name in ("monitor", "trainer0", "trainer1"):
        assert "Traceback" not in (root / f"{name}.log").read_text(), name
        written = tomllib.loads((root / name / "config.toml").read_text())
        assert written["run"]["weight_decay"] == 0.3 and written["run"]["target_batch_size"] == 32, name
        assert written["run"]["preset"] == "albert-tiny" and written["peer"]["matchmaking_time"] == 1.5, name
        assert written["peer"]["output_dir"] == str(root / name)
        assert written["peer"]["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"]
    # the monitor's sum of the trainers' contributions grows by about 32 samples per global step, measured
    # while both trainers report: each peer also finishes the micro-batch in flight when the swarm reaches the
    # target (8 samples per peer, +50% of 32), and a progress record read a moment late at either end of a
    # window of a few steps counts a micro-batch more per peer there: still below albert-tiny's 64
    rows = [r for r in read_rows(root / "monitor" / "metrics.jsonl") if r.get("loss") is not None]
    both = [r for r in rows if r["alive_peers"] == 2]
    assert len(both) >= 3, rows
    first, last = both[0], both[-1]
    per_step = (last["samples"] - first["samples"]) / (last["step"] - first["step"])
    assert 0.8 * 32 <= per_step < 2 * 32, (per_step, rows)


@pytest.mark.parametrize(
    ("losses", "first", "last"),
    [
        ([9.3, 9.0, 8.5], 9.3, 8.5),  # 3 steps: the first against the last
        ([9.4, 9.2, 9.1, 8.9], 9.3, 9.0),
        ([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0], 8.0, 3.0),
        ([9.0], 9.0, 9.0),  # one step shows no fall
    ],
)
def test_the_summary_compares_windows_of_steps_that_never_overlap(losses, first, last):
    from cotrain.demo import summarize

    rows = [{"step": i + 1, "loss": loss, "max_group_size": 2} for i, loss in enumerate(losses)]
    rows.insert(1, {"step": 1, "loss": None})  # rows without a loss are not steps
    summary = summarize(rows, peers=2, seconds=1.0)
    assert summary["loss_first"] == pytest.approx(first) and summary["loss_last"] == pytest.approx(last)
    assert summary["global_steps"] == len(losses)
