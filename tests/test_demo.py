"""`cotrain demo` end to end, as a new user runs it, and interrupted with Ctrl+C."""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import Role, alive, wait_until

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(600)
def test_demo_trains_a_real_swarm_and_reports(tmp_path):
    role = Role(
        ["demo", "--peers", "2", "--steps", "5", "--output-dir", str(tmp_path)], tmp_path / "demo.log"
    )
    role.proc.wait(timeout=580)
    text = role.text()
    summary = json.loads(
        [line for line in text.splitlines() if line.startswith('{"event": "demo_summary"')][-1]
    )
    assert role.proc.returncode == 0, text
    assert summary["peers"] == 2 and summary["global_steps"] >= 5
    assert summary["max_group_size"] >= 2
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["samples"] > 0 and summary["seconds"] > 0
    assert "Traceback" not in text
    for name in ("monitor", "trainer0", "trainer1"):
        assert "Traceback" not in (tmp_path / "demo" / f"{name}.log").read_text(), name


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_whole_demo_within_15_seconds(tmp_path):
    role = Role(
        ["demo", "--peers", "2", "--steps", "1000", "--output-dir", str(tmp_path)], tmp_path / "demo.log"
    )
    wait_until(lambda: "[demo] global step " in role.text(), 240, what="the demo's first global step")
    pids = role.tree()
    assert len(pids) >= 9, pids  # demo, 3 supervisors, 3 workers, their DHT processes and daemons
    t = time.monotonic()
    role.signal_group(signal.SIGINT)
    role.proc.wait(timeout=15)
    while alive(pids) and time.monotonic() - t < 15:
        time.sleep(0.25)
    assert not alive(pids), f"left behind after Ctrl+C: {alive(pids)}"
    assert "Traceback" not in role.text()


@pytest.mark.timeout(600)
def test_every_run_flag_of_the_demo_reaches_every_peer(tmp_path):
    """`cotrain demo --weight-decay 0.3 --target-batch-size 32`: each peer's resolved config (its
    OUTPUT_DIR/config.toml) shows both, and the swarm's steps are 32 samples, not albert-tiny's 64."""
    import tomllib

    from conftest import read_rows

    args = ["demo", "--peers", "2", "--steps", "6", "--output-dir", str(tmp_path), "--dashboard-port", "-1"]
    role = Role([*args, "--weight-decay", "0.3", "--target-batch-size", "32", "--matchmaking-time", "1.5"],
                tmp_path / "demo.log")  # fmt: skip
    try:
        role.proc.wait(timeout=560)
    finally:
        role.stop()
    root = tmp_path / "demo"
    for name in ("monitor", "trainer0", "trainer1"):
        written = tomllib.loads((root / name / "config.toml").read_text())
        assert written["run"]["weight_decay"] == 0.3 and written["run"]["target_batch_size"] == 32, name
        assert written["run"]["preset"] == "albert-tiny" and written["peer"]["matchmaking_time"] == 1.5, name
        assert written["peer"]["output_dir"] == str(root / name)
        assert written["peer"]["host_maddrs"] == ["/ip4/127.0.0.1/tcp/0"]
    assert role.proc.returncode == 0, role.text()[-3000:]
    # the monitor's sum of the trainers' contributions grows by about 32 samples per global step, measured
    # while both trainers report: each peer also finishes the micro-batch in flight when the swarm reaches the
    # target (8 samples per peer, +50% of 32), so up to 1.75 x 32, still clearly below albert-tiny's 64
    rows = [r for r in read_rows(root / "monitor" / "metrics.jsonl") if r.get("loss") is not None]
    both = [r for r in rows if r["alive_peers"] == 2]
    assert len(both) >= 3, rows
    first, last = both[0], both[-1]
    per_step = (last["samples"] - first["samples"]) / (last["step"] - first["step"])
    assert 0.8 * 32 <= per_step <= 1.75 * 32, (per_step, rows)
