"""The NAT benchmark's count of the steps a trainer averaged with others and with everyone."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import nat  # noqa: E402


def test_the_nat_benchmark_counts_the_steps_a_trainer_averaged_with_others_and_with_everyone():
    rows = [
        {"step": 1, "time": 110.0, "group_size": 1, "rounds_averaged": 0, "rounds_failed": 1},
        {"step": 2, "time": 120.0, "group_size": 2, "rounds_averaged": 1, "rounds_failed": 1},
        {"kind": "other"},
        {"step": 3, "time": 130.0, "group_size": 3, "rounds_averaged": 2, "rounds_failed": 1},
    ]
    got = nat.trainer_summary(rows, started=100.0, everyone=3)
    assert got == {"joined": True, "steps": 3, "averaged": 2, "with_all": 1, "with_all_share": 0.333,
                   "rounds_averaged": 2, "rounds_failed": 1, "first_step_s": 10.0}  # fmt: skip
    assert nat.trainer_summary([], started=100.0, everyone=3)["joined"] is False
    # the steps while every trainer was up (from the last one's first step to the first one's stop)
    windowed = nat.trainer_summary(rows, started=100.0, everyone=3, window=(115.0, 135.0))
    assert windowed["steps_while_all"] == 2 and windowed["with_all_while_all_share"] == 0.5
    assert windowed["rounds_failed_while_all"] == 0  # the failed round came before the window
    rows[-1]["rounds_failed"] = 2
    assert nat.trainer_summary(rows, 100.0, 3, window=(115.0, 135.0))["rounds_failed_while_all"] == 1
