"""The endurance benchmark's measures: memory growth per process kind, what backs it, the longest step, the
held-out and the training loss."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import soak  # noqa: E402
from lib import procs  # noqa: E402


def test_the_soak_measures_growth_per_process_kind_after_the_settling_time():
    def rows(worker, dht):
        return [{"kind": "worker", "pss": worker}, {"kind": "dht", "pss": dht}, {"kind": "dht", "pss": 10.0}]

    # before the settling time (t < 100) the worker grew from 50 to 100: not counted; after it, the worker
    # holds 100 then 110 (mean of the first quarter 100, of the last 110), the DHT processes stay at 30 + 10
    samples = [(0.0, rows(50.0, 30.0)), (50.0, rows(100.0, 30.0))]
    samples += [(100.0 + t, rows(100.0 if t < 40 else 110.0, 30.0)) for t in range(0, 80, 10)]
    growth = soak.memory_growth(samples, since=100.0)
    assert growth["worker"] == pytest.approx(0.1) and growth["dht"] == 0.0
    assert growth["total"] == pytest.approx(10 / 140, abs=1e-4)
    assert soak.memory_growth(samples[:3], since=100.0) == {}  # one sample after settling: nothing to say


def test_the_soak_splits_each_kinds_memory_by_what_backs_it():
    rows = [
        {"kind": "averager", "pss": 30.0, "pss_anon": 20.0, "pss_file": 8.0, "pss_shmem": 2.0},
        {"kind": "averager", "pss": 10.0, "pss_anon": 5.0, "pss_file": 5.0, "pss_shmem": 0.0},
        {"kind": "worker", "pss": 50.0},  # a kernel without smaps_rollup
    ]
    assert soak.per_kind_split(rows) == {
        "averager": {"pss_anon": 25.0, "pss_file": 13.0, "pss_shmem": 2.0},
        "worker": {},
    }
    mine = procs.pss_split(os.getpid())  # this process, read from /proc
    if mine:
        assert set(mine) == {"pss_anon", "pss_file", "pss_shmem"} and mine["pss_anon"] > 0


def test_the_soak_finds_the_longest_step_and_the_held_out_loss():
    monitor = [
        {"step": 1, "time": 100.0}, {"step": 1, "time": 101.0}, {"step": 2, "time": 110.0},
        {"kind": "eval", "step": 2, "time": 112.0, "eval_loss": 9.0},
        {"step": 3, "time": 120.0}, {"step": 4, "time": 190.0},
        {"kind": "eval", "step": 4, "time": 195.0, "eval_loss": 8.0},
        {"kind": "eval", "step": 4, "time": 300.0, "eval_loss": 7.5},
    ]  # fmt: skip
    assert soak.step_gaps(monitor) == (10.0, 70.0)  # gaps 10, 10, 70 between the steps' first rows
    assert soak.held_out(monitor, settle_at=200.0) == [9.0, 8.0, 7.5]
    assert soak.held_out([], settle_at=200.0) == [] and soak.step_gaps([]) == (0.0, 0.0)


def test_the_soak_averages_the_training_loss_over_windows_of_global_steps():
    rows = [{"step": s, "time": 100.0 + s, "loss": 10.0 - s / 10} for s in range(1, 101)]
    rows += [{"kind": "eval", "step": 50, "time": 150.5, "eval_loss": 1.0}, {"step": 101, "time": 201.0}]
    first, at_settle, last = soak.training_loss(rows, settle_at=150.0, window=10)
    assert first == pytest.approx(10.0 - 5.5 / 10)  # steps 1-10
    assert at_settle == pytest.approx(10.0 - 45.5 / 10)  # steps 41-50, the last before t = 150
    assert last == pytest.approx(10.0 - 95.5 / 10)  # steps 91-100 (101 has no loss)
    assert soak.training_loss([], settle_at=150.0) == []
