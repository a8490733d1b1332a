"""Helpers of the benchmarks: the all-reduce bound, namespace names, convergence curves, the overhead script's
arms, the footprint's process kinds, the step benchmarks' arms, the rounds simulation's averaging, the libp2p
all-to-all reference (live, on 127.0.0.1), and the home router's NAT between namespaces (where root, iproute2
and nftables allow)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import _netns  # noqa: E402
import _steps  # noqa: E402
import activations  # noqa: E402
import convergence  # noqa: E402
import footprint  # noqa: E402
import nat  # noqa: E402
import overhead  # noqa: E402
import rounds_sim  # noqa: E402
import scale  # noqa: E402
import soak  # noqa: E402


def test_allreduce_bound_is_twice_n_minus_one_over_n_messages_at_link_rate():
    fp16 = 17_847_474 * 2  # ALBERT-large's gradients in fp16, bytes
    assert _netns.allreduce_bound_s(2, fp16, 100e6) == pytest.approx(fp16 * 8 / 100e6)  # 2.856 s
    assert _netns.allreduce_bound_s(4, fp16, 100e6) == pytest.approx(1.5 * fp16 * 8 / 100e6)
    assert _netns.allreduce_bound_s(8, fp16, 50e6) == pytest.approx(1.75 * fp16 * 8 / 50e6)
    assert _netns.allreduce_bound_s(1, fp16, 100e6) == 0.0  # nothing to exchange alone


@pytest.mark.parametrize("name", ["cotrain-bench-123-h0", "cotrain-bench-123-br", "a", "x_y.z-1"])
def test_namespace_names_that_ip_netns_stores_as_plain_files_are_accepted(name):
    assert _netns.valid_netns_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "../etc", "a/b", "-x", "has space", "x" * 64, "ns\n"])
def test_namespace_names_with_paths_or_odd_characters_are_refused(name):
    assert not _netns.valid_netns_name(name)


def test_only_this_benchmarks_own_namespaces_count_as_stale_candidates():
    assert _netns._OURS.match(f"{_netns.PREFIX}-4242-h3").group(1) == "4242"
    assert _netns._OURS.match("cotrain-part-4242-h3") is None  # another program's namespaces are left alone
    assert _netns._OURS.match("netns0") is None


def test_swarm_curve_weights_each_trainers_loss_by_the_samples_it_contributed():
    a = [{"step": 1, "loss": 9.0, "contribution": 48}, {"step": 2, "loss": 8.0, "contribution": 80}]
    b = [{"step": 1, "loss": 7.0, "contribution": 16}, {"step": 2, "loss": 6.0, "contribution": 48}]
    curve = convergence.swarm_curve([a, b])
    assert curve[0] == (1, 64, pytest.approx((9.0 * 48 + 7.0 * 16) / 64))
    assert curve[1] == (2, 128, pytest.approx((8.0 * 32 + 6.0 * 32) / 64))


def test_final_loss_interpolates_the_curve_over_the_sample_window():
    curve = [(1, 64, 10.0), (2, 128, 8.0), (3, 192, 6.0)]
    assert convergence.final_loss(curve, 128, 192) == pytest.approx(7.0)
    assert math.isnan(convergence.final_loss(curve, 128, 256))  # the run did not reach the window


def test_whole_articles_join_each_wikitext_articles_paragraphs_into_one_document(tmp_path):
    source = tmp_path / "wiki.txt"
    source.write_text(
        " \n = First = \n \n First paragraph . \n \n = = Section = = \n \n Second paragraph . \n"
        " \n = Second = \n \n Third paragraph . \n",
        encoding="utf-8",
    )
    joined = overhead.join_articles(str(source), tmp_path / "articles.txt").read_text(encoding="utf-8")
    assert joined.split("\n\n") == [
        "First paragraph . Second paragraph .",
        "Third paragraph .\n",
    ]


def test_the_peer_arm_gets_the_same_model_precision_and_batches_as_the_plain_loop(tmp_path):
    args = argparse.Namespace(
        preset="albert-large-v2", threads=8, micro_batch=32, steps=4, accumulation=4, device="cuda",
        precision="bf16", target_batch_size=1024, cotrain_args=["--verbose"],
    )  # fmt: skip
    cmd = overhead.cotrain_command(args, tmp_path / "data", tmp_path / "out", "r1")
    flags = " ".join(cmd[cmd.index("train") + 1 :])
    for expected in (
        "--preset albert-large-v2",
        "--per-device-train-batch-size 32",
        "--gradient-accumulation-steps 4",
        "--devices cuda",
        "--bf16",
        "--target-batch-size 1024",
        "--max-steps 4",
        "--torch-threads 8",
    ):
        assert expected in flags
    assert flags.endswith("--verbose")
    assert overhead.run_config(args).target_batch_size == 1024
    args.precision, args.target_batch_size = "fp32", 0
    cmd = overhead.cotrain_command(args, tmp_path / "data", tmp_path / "out", "r1")
    assert "--fp32" not in cmd and "--target-batch-size" not in cmd
    assert overhead.run_config(args).target_batch_size == 4096  # the preset's


@pytest.mark.timeout(120)
def test_the_libp2p_exchange_delivers_every_byte_to_every_peer():
    """allreduce.py's transport reference: three DHTs on 127.0.0.1, each sending 3 MiB to each other one over
    raw libp2p streams through its daemon; every peer receives 2 x 3 MiB, after the common start."""
    import threading
    import time

    import hivemind

    import allreduce

    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    for _ in range(2):
        dhts.append(
            hivemind.DHT(
                start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dhts[0].get_visible_maddrs()
            )
        )
    exchanges = []
    try:
        exchanges = [allreduce.P2PExchange(dht) for dht in dhts]
        ids = [str(dht.peer_id) for dht in dhts]
        size, at, answers = 3 << 20, time.time() + 2.0, {}

        def run(i: int) -> None:
            answers[i] = exchanges[i].run(ids, size, at)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in range(3):
            assert answers.get(i, {}).get("got") == 2 * size, answers
            assert answers[i]["end"] > at
    finally:
        for exchange in exchanges:
            exchange.close()
        for dht in dhts:
            dht.shutdown()


def test_the_footprint_names_each_process_of_a_roles_tree():
    worker = ("python", "-m", "cotrain._worker", "train", "--resolved-config", "f")
    P = footprint.Proc
    procs = [
        P(10, 1, "python", ("python", "-m", "cotrain", "train")),
        P(11, 10, "python", worker),
        P(12, 11, "torch_shm_manager", ("torch_shm_manager",)),
        P(13, 11, "python", worker),  # the DHT: its child is p2pd
        P(14, 13, "p2pd", ("p2pd", "-listen")),
        P(15, 11, "python", worker),
        P(16, 11, "python", worker),
        P(17, 11, "sh", ("sh", "-c", "nvidia-smi")),
    ]
    assert footprint.kinds(procs, 10) == {
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


def test_the_scale_configuration_waits_for_newcomers_that_have_not_contributed(tmp_path):
    swarm = scale.Swarm(scale.parse_args(["--peers", "2", "--minutes", "1"]), 0, False, tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        now = time.monotonic()
        swarm.procs = dict(enumerate(procs))
        # trainers 0 and 1 were there at t0; 2 is a newcomer that contributed; 3 one that has not
        swarm.started = {0: now - 100, 1: now - 100, 2: now - 50, 3: now - 40}
        swarm.inbox = {0: [], 1: [], 2: [{"contributing": 12.0, "at": now - 38}], 3: [{"epoch": 1}]}
        assert swarm.newcomers_waiting(now - 90, timeout=60) == [3]
        assert swarm.newcomers_waiting(now - 90, timeout=30) == []  # started too long ago
        swarm.killed = [3]
        assert swarm.newcomers_waiting(now - 90, timeout=60) == []  # its host vanished
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_the_scale_benchmark_counts_the_dht_requests_of_a_peer(monkeypatch):
    """DhtBytes, installed before a DHT starts, counts what its requests and their answers carry."""
    import hivemind
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.utils import get_dht_time

    monkeypatch.setattr(DHTProtocol, "get_stub", DHTProtocol.get_stub)  # restored after the test
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    counts = scale.DhtBytes()
    counts.install()
    second = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
    )
    try:
        before = counts.snapshot()
        assert second.store("scale-test", "x" * 5000, get_dht_time() + 60)
        after_store = counts.snapshot()
        assert after_store["store"] - before["store"] > 5000
        assert (
            first.get("scale-test", latest=True).value == "x" * 5000
        )  # the first DHT's requests: not counted
        assert counts.snapshot()["store"] == after_store["store"]
    finally:
        second.shutdown()
        first.shutdown()


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
    mine = footprint.pss_split(os.getpid())  # this process, read from /proc
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


@pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "tc", "nft")),
    reason="needs root, iproute2 and nftables to build namespaces and a NAT",
)
def test_a_host_behind_the_home_router_dials_out_and_cannot_be_dialed():
    with _netns.Network(4, 0) as net:
        home, other = net.add_nat_host(router=2), net.add_nat_host(router=3)
        assert (home, net.address(home), net.address(other)) == (4, "10.214.0.2", "10.214.1.2")
        assert _netns.tcp_connects(net, home, net.address(1), dst=1)  # out through the router
        assert not _netns.tcp_connects(net, 1, net.address(home), dst=home)  # no route to a private address
        assert not _netns.tcp_connects(net, 1, net.address(2), dst=home)  # no port forwarding at the router
        assert _netns.tcp_connects(net, 1, net.address(2), dst=2)  # the router's own ports answer
        assert not _netns.tcp_connects(net, other, net.address(2), dst=home)  # nor from another home
        assert nat.nat_reach(net, [home, other])["home1_dials_out"]
        names = net.created[:]
    assert not set(names) & set(_netns.list_netns())  # every namespace deleted


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


def test_the_aux_load_benchmark_reads_a_round_s_bytes_at_the_reducers():
    import aux_load

    class Counters:  # host 0 the reducer, hosts 1 and 2 its clients: (sent, received) over the window
        def between(self, t0, t1):
            assert (t0, t1) == (10.0, 32.0)
            return [(80e6, 78e6), (40e6, 41e6), (39e6, 40e6)]

    def mark(t, compute, on_device, in_step, failed):
        return {"t": t, "compute": compute, "on_device": on_device, "in_step": in_step, "rounds": [3, failed],
                "round_bytes": 35e6}  # fmt: skip

    marks = {
        1: {1: mark(10.0, 5, 1, 3, 0), 3: mark(30.0, 15, 3, 23, 0)},
        2: {1: mark(11.0, 5, 1, 3, 0), 3: mark(32.0, 15, 3, 27, 1)},
    }
    got = aux_load.summarize("diloco", marks, Counters(), [0], (1, 3), 100.0, [[2, 0]])
    assert (got["clients"], got["reducers"], got["seconds_per_round"]) == (2, 1, 11.0)
    assert got["compute_per_round"] == 6.0 and got["waited_per_round"] == 10.0  # (20 + 24) / 4 - 1
    assert (got["reducer_received_per_round"], got["reducer_sent_per_round"]) == (39e6, 40e6)
    assert got["client_sent_per_round"] == 19.75e6 and got["failed_rounds"] == 1
    assert got["bound_s"] == pytest.approx(2 * 35e6 / 12.5e6)  # 2 vectors through one 100 Mbit/s link


def test_the_allreduce_table_puts_the_libp2p_arm_beside_the_direct_one(capsys):
    import argparse

    import allreduce

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


def test_step_arms_alternate_their_order_and_report_their_means(capsys):
    order: list[str] = []

    def fake(arm: dict) -> dict:
        order.append(arm["name"])
        return {"s_per_step": arm["s"] + len(order) % 2, "rss_mib": 100.0, "peak_mib": 150.0}

    arms = {"a": {"name": "a", "s": 1.0}, "b": {"name": "b", "s": 2.0}}
    summary = _steps.alternate(arms, 2, run=fake)
    assert order == ["a", "b", "b", "a"]  # the second round reversed
    both = {"rss_mib": 100, "peak_mib": 150}
    assert summary == {"a": {"s_per_step": 1.5, **both}, "b": {"s_per_step": 2.5, **both}}
    _steps.print_table(summary, "a")
    out = capsys.readouterr().out
    assert "peak MiB" in out and out.splitlines()[-1].split() == ["b", "2.500", "1.67", "100", "150"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arm", [{"loss": "full"}, {"loss": "forward_loss"}, {"loss": "forward_loss", "unfused_gelu": True}]
)
def test_a_step_arm_trains_its_preset_in_a_fresh_process(arm):
    got = _steps.run_steps(
        {"preset": "albert-tiny", "steps": 2, "warmup": 1, "batch": 2, "length": 32, **arm}
    )
    # the kernel updates the peak (getrusage's maxrss) lazily: the RSS read last can exceed it by a few pages
    assert got["s_per_step"] > 0 and got["peak_mib"] >= 0.99 * got["rss_mib"] and got["rss_mib"] > 50, got


def test_the_activations_benchmark_counts_what_a_forward_keeps_and_what_checkpointing_leaves():
    from cotrain import config as cfg

    run = cfg.resolve("llama-tiny").run
    result = activations.measure("llama-tiny")
    seq, hidden = run.max_seq_length, run.model["hidden_size"]
    assert result["seq"] == seq and result["layers"] == run.model["num_hidden_layers"]
    # a checkpointed layer keeps its input alone: the hidden states of the micro-batch, in bfloat16
    assert result["checkpointing_per_layer"] == seq * hidden * 2
    assert result["full_per_layer"] > 10 * result["checkpointing_per_layer"]
    assert result["checkpointing_kept"] < result["checkpointing_peak"] < result["full_kept"]
    assert result["full_rest"] == pytest.approx(result["checkpointing_rest"], rel=0.05)  # the head's, alike


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_sparse_overlapped_round_end_takes_no_fresh_memory_of_the_models_size(tmp_path):
    # a lone peer of 4M parameters (16 MB, 3,900 pages of 4 KiB): its round ends fault in a few pages, where
    # fresh vectors of the model's size would fault in thousands each (benchmarks/round_end.py)
    script = [sys.executable, str(REPO / "benchmarks" / "round_end.py")]
    out = subprocess.run(
        [*script, "--model-params", "4000000", "--rounds", "3", "--local-steps", "2"],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (tree,) = json.loads(out.stdout.splitlines()[-1])["trees"]
    assert tree["rounds"] == 2 and tree["wall"] > 0, tree
    assert tree["minflt"] < 400, tree
    bad = subprocess.run([*script, "--src", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and f"{tmp_path} holds no cotrain package" in bad.stderr, bad.stderr


def test_the_rounds_simulation_averages_as_a_swarm_of_sparse_rounds_does():
    import torch

    from cotrain.algorithms.sparse import TopK

    arm = rounds_sim.Arm.parse("topk:decay=0.9:density=0.03125:exact=lm_head,embed")
    assert (arm.codec, arm.exact, arm.union, arm.sparse) == (
        {"decay": 0.9, "density": 0.03125},
        ("lm_head", "embed"),
        False,
        True,
    )
    for bad in ("sparse", "dense:decay=0.9", "topk:colour=red", "topk:exact="):
        with pytest.raises(ValueError):
            rounds_sim.Arm.parse(bad)
    assert rounds_sim.spans(16_379, 4096, 2) == [(0, 8192), (8192, 16_379)]  # whole chunks, all covered
    codec, numel, n = TopK(decay=0.9), 3 * 4096, 3
    changes = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    feedback = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]
    wholes = [torch.add(c, f, alpha=0.9) for c, f in zip(changes, feedback, strict=True)]
    none = torch.zeros(numel, dtype=torch.bool)
    dense = rounds_sim.average(
        rounds_sim.Arm.parse("dense"), None, [c.clone() for c in changes], [], none, None
    )
    assert torch.allclose(dense, torch.stack(changes).mean(0))
    g = torch.Generator().manual_seed(0)
    mine = [f.clone() for f in feedback]
    out = rounds_sim.average(
        arm.__class__.parse("topk:decay=0.9"), codec, [c.clone() for c in changes], mine, none, g
    )
    sent = [codec.decode(codec.encode(w), numel) for w in wholes]
    mean = torch.stack(sent).mean(0)
    # the group's average is re-encoded to k per chunk; each peer keeps what it did not send, and the reducers
    # keep n times what the re-encoding left out, so that nothing is lost overall
    assert ((out.view(-1, 4096) != 0).sum(1) <= codec.k).all()
    total = sum(mine) - sum(w - s for w, s in zip(wholes, sent, strict=True))
    assert torch.allclose(total, n * (mean - out), atol=1e-5)
    # parameters sent exactly skip the codec on both sides
    everything = torch.ones(numel, dtype=torch.bool)
    exact = rounds_sim.average(
        arm, codec, [c.clone() for c in changes], [f.clone() for f in feedback], everything, g
    )
    assert torch.allclose(exact, torch.stack(wholes).mean(0), atol=1e-6)


def test_the_rounds_simulations_forms_for_vocabulary_matrices_lose_nothing_overall():
    import torch

    arm = rounds_sim.Arm.parse("topk:decay=0.9:vdensity=0.125:vbits=4:vrows=0.25")
    assert (arm.vocab, arm.form) == ({"density": 0.125, "bits": 4}, ("rows", 0.25))
    assert rounds_sim.Arm.parse("topk:vshared").form == ("shared", 0.0)
    shapes = [torch.Size([64, 16]), torch.Size([32, 16])]
    flat = torch.randn(sum(s.numel() for s in shapes), generator=torch.Generator().manual_seed(0))
    there = rounds_sim.dct_rows(flat, shapes, 8)
    assert torch.allclose(there.norm(), flat.norm()) and not torch.allclose(there, flat)  # orthonormal
    assert torch.allclose(rounds_sim.dct_rows(there, shapes, 8, inverse=True), flat, atol=1e-5)
    rows = rounds_sim.top_rows(0.25)(flat[:1024].view(64, 16))
    assert (rows.abs().sum(1) > 0).sum() == 16  # a quarter of the rows, in two levels each
    assert all(len(set(r.abs().tolist()) - {0.0}) <= 2 for r in rows)
    assert torch.linalg.matrix_rank(rounds_sim.low_rank(2)(flat[:1024].view(64, 16))) == 2
    n = 3
    changes = [torch.randn(flat.numel(), generator=torch.Generator().manual_seed(i)) for i in range(n)]
    feedback = [torch.randn(flat.numel(), generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]
    before = [f.clone() for f in feedback]
    for form, reencode in ((rounds_sim.top_rows(0.25), True), (rounds_sim.low_rank(2), False)):
        mine, g = [f.clone() for f in before], torch.Generator().manual_seed(0)
        out = rounds_sim.per_matrix(form, shapes, [c.clone() for c in changes], mine, 0.9, g, reencode)
        # what the peers meant to send, less what the group applies, is in the buffers, n times over
        wholes = sum(c + 0.9 * f for c, f in zip(changes, before, strict=True))
        assert torch.allclose(wholes - n * out, sum(mine), atol=1e-4)
