"""The benchmarks' machinery run for real: the libp2p all-to-all reference and the DHT's byte counts (live, on
127.0.0.1), the home router's NAT between namespaces, a step arm and a lone peer's round ends in fresh
processes, and a swarm of two simulated peers on namespaced hosts for a few rounds (where root and iproute2
allow)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import allreduce  # noqa: E402
import nat  # noqa: E402
import scale  # noqa: E402
import traffic  # noqa: E402
from lib import netns, steps  # noqa: E402

NAMESPACES = os.geteuid() == 0 and all(shutil.which(c) for c in ("ip", "tc"))


@pytest.mark.timeout(120)
def test_the_libp2p_exchange_delivers_every_byte_to_every_peer():
    """allreduce.py's transport reference: three DHTs on 127.0.0.1, each sending 3 MiB to each other one over
    raw libp2p streams through its daemon; every peer receives 2 x 3 MiB, after the common start."""
    import hivemind

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


@pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "tc", "nft")),
    reason="needs root, iproute2 and nftables to build namespaces and a NAT",
)
def test_a_host_behind_the_home_router_dials_out_and_cannot_be_dialed():
    with netns.Network(4, 0) as net:
        home, other = net.add_nat_host(router=2), net.add_nat_host(router=3)
        assert (home, net.address(home), net.address(other)) == (4, "10.214.0.2", "10.214.1.2")
        assert netns.tcp_connects(net, home, net.address(1), dst=1)  # out through the router
        assert not netns.tcp_connects(net, 1, net.address(home), dst=home)  # no route to a private address
        assert not netns.tcp_connects(net, 1, net.address(2), dst=home)  # no port forwarding at the router
        assert netns.tcp_connects(net, 1, net.address(2), dst=2)  # the router's own ports answer
        assert not netns.tcp_connects(net, other, net.address(2), dst=home)  # nor from another home
        assert nat.nat_reach(net, [home, other])["home1_dials_out"]
        names = net.created[:]
    assert not set(names) & set(netns.list_netns())  # every namespace deleted


@pytest.mark.slow
@pytest.mark.parametrize(
    "arm", [{"loss": "full"}, {"loss": "forward_loss"}, {"loss": "forward_loss", "unfused_gelu": True}]
)
def test_a_step_arm_trains_its_preset_in_a_fresh_process(arm):
    got = steps.run_steps({"preset": "albert-tiny", "steps": 2, "warmup": 1, "batch": 2, "length": 32, **arm})
    # the kernel updates the peak (getrusage's maxrss) lazily: the RSS read last can exceed it by a few pages
    assert got["s_per_step"] > 0 and got["peak_mib"] >= 0.99 * got["rss_mib"] and got["rss_mib"] > 50, got


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
    # a fresh vector of the model's size faults in its 3,906 pages; the round end's own few hundred vary with
    # the machine's load (up to about 500 seen), so the bound is a quarter of one such vector
    assert tree["minflt"] < 4_000_000 * 4 / 4096 / 4, tree
    bad = subprocess.run([*script, "--src", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and f"{tmp_path} holds no cotrain package" in bad.stderr, bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not NAMESPACES, reason="needs root and iproute2 (ip, tc) to build network namespaces")
def test_two_simulated_peers_average_sparse_rounds_over_shaped_namespaced_links(
    tmp_path, monkeypatch, network_guard
):
    """traffic.py's smallest real path: two simulated peers (lib/simulated.py run as their own processes, a
    model of 1M parameters, DiLoCo with sparse rounds, H = 2), each on a namespaced host behind a 100 Mbit/s
    link, a warm-up round then a timed one; the links' counters see every host send at least its payload, and
    every namespace is gone afterwards."""

    class Guarded(netns.Network):  # the peers listen on the namespaces' own addresses: the guard allows them
        def create(self) -> None:
            super().create()
            for name in self.created:
                network_guard.allow_namespace(name)

    monkeypatch.setattr(netns, "Network", Guarded)
    args = traffic.parse_args(
        ["--peers", "2", "--no-sync", "--topk", "--no-dense", "--local-steps", "2", "--rounds", "1",
         "--model-params", "1000000", "--step-time", "0.01", "--micro-batch", "1", "--accumulation", "1",
         "--matchmaking-time", "2", "--limit", "200"]
    )  # fmt: skip
    ((name, mode, h, timed),) = traffic.configs(args)
    row = traffic.run_config(name, mode, h, timed, args, tmp_path)
    assert row["ok"], row
    assert row["samples"] >= timed * h * args.target_batch_size, row  # a round: H x the swarm's batch
    assert row["round_bytes"] > 0 and row["sent_per_peer_per_step"] >= row["round_bytes"], row
    ours = f"{netns.PREFIX}-{os.getpid()}-"
    assert not [n for n in netns.list_netns() if n.startswith(ours)], "a namespace outlived the run"


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
