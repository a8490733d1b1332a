"""The footprint's process kinds (benchmarks/lib/procs.py) and its summary per kind."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import footprint  # noqa: E402
from lib import procs  # noqa: E402


def test_the_footprint_names_each_process_of_a_roles_tree():
    worker = ("python", "-m", "cotrain._worker", "train", "--resolved-config", "f")
    P = procs.Proc
    tree = [
        P(10, 1, "python", ("python", "-m", "cotrain", "train")),
        P(11, 10, "python", worker),
        P(12, 11, "torch_shm_manager", ("torch_shm_manager",)),
        P(13, 11, "python", worker),  # the DHT: its child is p2pd
        P(14, 13, "p2pd", ("p2pd", "-listen")),
        P(15, 11, "python", worker),
        P(16, 11, "python", worker),
        P(17, 11, "sh", ("sh", "-c", "nvidia-smi")),
    ]
    assert procs.kinds(tree, 10) == {
        10: "supervisor", 11: "worker", 12: "torch_shm_manager", 13: "dht", 14: "p2pd", 15: "averager",
        16: "averager", 17: "other",
    }  # fmt: skip


def test_the_footprint_summary_sums_kinds_takes_medians_and_measures_growth():
    def rows(worker_pss: float) -> list[dict]:
        return [
            {"pid": 1, "kind": "worker", "rss": 500, "pss": worker_pss, "uss": 100},
            {"pid": 2, "kind": "averager", "rss": 300, "pss": 50, "uss": 10},
            {"pid": 3, "kind": "averager", "rss": 300, "pss": 50, "uss": 10},
        ]

    table = footprint.summarize([rows(p) for p in (100, 100, 150, 150)])
    assert table["averager"] == {"rss": 600, "pss": 100, "uss": 20, "processes": 2}
    assert table["worker"]["pss"] == 125 and table["total"]["pss"] == 225
    assert table["total"]["pss_growth"] == pytest.approx(50 / 200)
