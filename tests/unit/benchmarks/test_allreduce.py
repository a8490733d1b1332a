"""The all-reduce benchmark's arms and table."""

from __future__ import annotations

import argparse
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import allreduce  # noqa: E402


def test_the_allreduce_table_puts_the_libp2p_arm_beside_the_direct_one(capsys):
    args = argparse.Namespace(aggregation="mean", libp2p_arm=True)
    assert allreduce.arms_of(args) == ("cotrain-libp2p", "cotrain", "hivemind")
    args.libp2p_arm = False
    assert allreduce.arms_of(args) == ("cotrain", "hivemind")

    def result(seconds):
        return {
            "ok": True,
            "seconds": seconds,
            "busy": 0.8,
            "overhead": 1.02,
            "err": 1e-4,
            "machine": 1.0,
            "ours": 0.9,
            "per_peer": [seconds],
            "group": 4,
        }

    results = {"cotrain-libp2p": [result(6.0)], "cotrain": [result(4.8)], "hivemind": [result(6.2)]}
    rows = [allreduce.row(4, 100.0, "fp16", 35.7e6, 4.28, 92.0, results, tcp=[4.6], libp2p=[5.8])]
    allreduce.print_table(rows)
    out = capsys.readouterr().out
    assert "| cotrain over libp2p | ratio |" in out
    assert "| 6.00 s | 1.402 |" in out and "**1.121**" in out  # libp2p arm, then the direct arm's ratio
    assert "cotrain over libp2p / cotrain direct: 1.250" in out
    assert "NOT met: worst 1.121" not in out and "met: worst 1.121" in out
