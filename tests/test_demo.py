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
