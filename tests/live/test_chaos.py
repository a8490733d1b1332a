"""Churn, the short version of benchmarks/chaos.py: three trainers and a monitor on 127.0.0.1, a trainer
killed like a vanishing machine (SIGKILL to its whole process tree) and replaced by a fresh one every ~12 s
(`cotrain status` is left to the long run). With the sync strategy: DiLoCo's churn (a peer killed mid-round,
late joiners) is tested in tests/live/test_diloco.py and tests/live/test_diloco_swarm.py, and
`benchmarks/chaos.py --strategy diloco` runs this very churn with it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cotrain_env

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(240)  # 30 s of churn, 2 kills; about 2 minutes in all on 2 idle cores
def test_the_swarm_trains_on_while_trainers_vanish_and_new_ones_join(demo_data, tmp_path):
    strategy = "sync"
    summary = tmp_path / "summary.json"
    driver = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "chaos.py"), "--duration", "30", "--kill-every", "12",
         "--trainers", "3", "--data", str(demo_data), "--out", str(tmp_path / "run"), "--json", str(summary),
         "--startup-timeout", "180", "--settle", "120", "--status-timeout", "0", "--strategy", strategy],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cotrain_env(),
    )  # fmt: skip
    try:
        output, _ = driver.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        driver.terminate()  # the driver stops every role in order, reports, then exits
        output, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:  # interrupted by the test's own time limit
            driver.terminate()
            driver.wait(timeout=60)
    assert summary.exists(), output[-5000:]
    r = json.loads(summary.read_text())
    assert r["interrupted"] is None, (r, output[-3000:])
    assert r["kills"] >= 2, r
    assert r["crashed_without_being_killed"] == [], r
    assert r["unclean_exits"] == [], r
    assert r["processes_left_behind"] == 0, r
    assert r["global_steps_during_churn"] >= 2, r
    assert r["loss_falls"], r
    assert r["parameters_finite"] is True, r
    assert r["replacements_that_took_a_step"] >= 1, r  # newcomers join and contribute under churn
    assert r["max_group_size"] >= 2, r
    assert r["monitor_rss_mib"]["max"] > 0, r
    assert driver.returncode == 0, output[-3000:]
    for log in (tmp_path / "run").glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log.name
