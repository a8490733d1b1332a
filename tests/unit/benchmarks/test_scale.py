"""The scale benchmark's swarm: its mix of hosts, its summary, and how long a configuration waits for its
newcomers."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import scale  # noqa: E402


def test_the_scale_trainers_mix_fast_slow_and_client_mode_hosts():
    rates = [scale.trainer_rate(k) for k in range(12)]
    assert rates.count(scale.SLOW_RATE) == 4 and rates.count(scale.FAST_RATE) == 8
    assert sum(scale.trainer_client(k) for k in range(16)) == 4
    args = scale.parse_args(["--quick"])
    assert (args.peers, args.group_sizes, args.minutes, args.churn) == (16, [4], 2.0, True)
    assert args.target_batch_size == 16 * args.micro_batch * 5
    with pytest.raises(SystemExit):
        scale.parse_args(["--group-sizes", "1"])
    swarm = scale.Swarm(scale.parse_args(["--peers", "4", "--churn", "--minutes", "1"]), 4, True, REPO)
    assert swarm.net.rates[:2] == [scale.FAST_RATE] * 2 and len(swarm.net.rates) == 2 + swarm.trainer_hosts


def test_the_scale_summary_counts_steps_groups_rounds_dht_traffic_and_newcomers(tmp_path):
    args = scale.parse_args(["--peers", "2", "--minutes", "1"])
    swarm = scale.Swarm(args, 0, False, tmp_path)
    swarm.started = {0: 0.0, 1: 0.0, 2: 30.0}  # trainer 2 is a newcomer, started after t0 = 10
    dht = {"ping": 0.0, "store": 0.0, "find": 0.0}

    def mark(at, epoch, group, averaged, failed, kib):
        return {"epoch": epoch, "at": at, "group": group, "averaged": averaged, "failed": failed,
                "dht_bytes": {**dht, "store": kib * 1024.0}}  # fmt: skip

    swarm.inbox = {
        0: [mark(5, 1, 1, 0, 0, 0), mark(12, 2, 2, 1, 0, 10), mark(42, 3, 3, 2, 1, 40)],
        1: [mark(12, 2, 2, 1, 0, 0), mark(42, 3, 3, 2, 0, 60)],
        2: [{"contributing": 25.5, "at": 56}, mark(56, 4, 3, 1, 0, 5)],
    }
    swarm.killed = []
    r = scale.summarize("x", 0, False, swarm, 10.0, 70.0, [800.0, 810.0, 600.0, 650.0], [], 1.5, 1.2)
    assert r["global_steps"] == 2 and r["steps_per_minute"] == 2.0  # steps 2 to 4 in the minute
    assert r["groups"] == {2: 2, 3: 3} and r["max_group_size"] == 3 and r["group_size"] == 2
    assert (r["rounds_averaged"], r["failed_rounds"]) == (2 + 2 + 1, 1)
    assert r["dht_kb_per_minute"] == 90.0 and r["dht_kb_per_minute_max"] == 120.0  # 30 and 60 KiB in 30 s
    assert r["dht_kb_per_minute_by_kind"]["store"] == 90.0
    assert r["newcomer_seconds"] == [25.5]
    assert (r["trainer_pss_mb"], r["monitor_pss_mb"], r["eval_pss_mb"]) == (805.0, 600.0, 650.0)
    line = scale.summary_line([r, {**r, "newcomer_seconds": [40.0, None], "failed_rounds": 2}], args)
    assert line["event"] == "scale_summary" and line["newcomer_seconds"] == 40.0
    assert line["newcomers_not_contributing"] == 1 and line["failed_rounds"] == 3
    assert line["global_steps"] == 4 and line["max_group_size"] == 3
