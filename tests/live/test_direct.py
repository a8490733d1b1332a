"""The direct TCP path of the all-reduce (cotrain.hivemind_ext.direct).

Here, with cotrain processes; the rest in tests/swarm/test_direct.py and
tests/unit/hivemind_ext/test_direct.py."""

import asyncio
import collections
import contextlib
import struct
import threading
import time

import pytest
import torch

from cotrain.algorithms.aggregation import build
from cotrain.hivemind_ext.direct import (
    parse_endpoint,
)
from support.averagers import averagers
from support.direct import closed


def run_round(tensors: list[list[torch.Tensor]], direct: list[bool]):
    """All-reduce ``tensors`` (one list per peer) once among averagers with cotrain's all-reduce, direct or
    not per peer; returns each peer's tensors, group sizes and transport counts. A round where the group
    split or a peer found none (matchmaking on a loaded machine) is run again, up to twice."""
    for attempt in range(3):
        out, sizes, counts = _run_round(tensors, direct)
        if all(size == len(tensors) for size in sizes) or attempt == 2:
            return out, sizes, counts


def _run_round(tensors, direct):
    made, dhts = averagers(
        tensors,
        build("mean"),
        direct,
        prefix="direct-test",
        min_matchmaking_time=4.0,
        next_chunk_timeout=10.0,
        part_size_bytes=2**14,  # several parts per stream
    )
    try:
        controls = [a.step(wait=False, timeout=40) for a in made]
        deadline = time.monotonic() + 60
        while not all(c.done() for c in controls) and time.monotonic() < deadline:
            time.sleep(0.2)
        sizes = [len(c.result()) if c.done() and not c.exception() else 0 for c in controls]
        out = []
        for a in made:
            with a.get_tensors() as ts:
                out.append([t.clone() for t in ts])
        return out, sizes, [a.transport_counts() for a in made]
    finally:
        for a in made:
            a.shutdown()
        for d in dhts:
            d.shutdown()


def peers_tensors(n: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [[torch.randn(20000, generator=gen), torch.randn(30, 50, generator=gen)] for _ in range(n)]


def assert_averaged(out, sizes, tensors):
    """Every peer was in the one group of all and holds the mean."""
    assert sizes == [len(tensors)] * len(tensors)
    mean = [sum(t[j] for t in tensors) / len(tensors) for j in range(len(tensors[0]))]
    for got in out:
        for g, e in zip(got, mean, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_peers_average_over_direct_connections():
    tensors = peers_tensors(3)
    out, sizes, counts = run_round(tensors, [True, True, True])
    assert_averaged(out, sizes, tensors)
    # each peer sent to the 2 other reducers directly and served the 2 others' streams
    assert counts == [{"direct": 2, "libp2p": 0, "served": 2}] * 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_without_the_direct_path_averages_over_libp2p_with_the_others():
    tensors = peers_tensors(3)
    out, sizes, counts = run_round(tensors, [True, True, False])
    assert_averaged(out, sizes, tensors)
    # the two direct peers reach each other directly; the third refuses offers, so they reach it over
    # libp2p, and it sends over libp2p only
    assert counts[0] == counts[1] == {"direct": 1, "libp2p": 1, "served": 1}
    assert counts[2] == {"direct": 0, "libp2p": 0, "served": 0}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_offer_naming_another_address_than_libp2p_reaches_is_not_dialled(monkeypatch):
    import cotrain.hivemind_ext.direct as direct

    # every reducer names an address its peers' libp2p connections do not use (the averagers are forked:
    # they inherit the patch); senders must not dial it and send over libp2p instead
    monkeypatch.setattr(direct, "endpoint", lambda ip, port: f"192.0.2.1 {port}")
    tensors = peers_tensors(2)
    out, sizes, counts = run_round(tensors, [True, True])
    assert_averaged(out, sizes, tensors)
    assert counts == [{"direct": 0, "libp2p": 1, "served": 0}] * 2


class Flood(threading.Thread):
    """An outsider on 127.0.0.1 against one reducer: a libp2p peer of its own that asks for offers (more than
    a peer may hold) and floods the reducer's direct endpoint, in waves until ``stop``: ``RAW`` bare
    connections (every other one sending junk instead of a ticket) and a stream per ticket whose first frame
    says it holds ``OVERSIZED`` bytes, and sends them."""

    RAW, OVERSIZED, OFFERS, LATER_OFFERS = 300, 16 << 20, 70, 24

    def __init__(self, averager, dht) -> None:
        super().__init__(daemon=True)
        self.averager, self.maddrs, self.peer = averager, dht.get_visible_maddrs(), dht.peer_id
        self.ready, self.go, self.stop = threading.Event(), threading.Event(), threading.Event()
        self.counts: collections.Counter = collections.Counter()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            self.ready.set()

    async def _main(self) -> None:
        from hivemind.p2p import P2P

        from cotrain.hivemind_ext.direct import DirectRequest

        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=self.maddrs)
        try:
            stub = type(self.averager).get_stub(p2p, self.peer, namespace=self.averager.prefix)
            first = await stub.rpc_direct_offer(DirectRequest(), timeout=10)  # the reducer starts listening
            host, port = parse_endpoint(first.endpoints[0])
            self.ready.set()
            while not self.go.wait(0.1):
                pass
            wanted = self.OFFERS
            while not self.stop.is_set():
                offers = [await stub.rpc_direct_offer(DirectRequest(), timeout=10) for _ in range(wanted)]
                self.counts["offers refused"] += sum(1 for o in offers if o.refusal)
                tickets = [o for o in offers if not o.refusal]
                await asyncio.gather(
                    *(self._raw(host, port, junk=i % 2 == 1) for i in range(self.RAW)),
                    *(self._oversized(host, port, o) for o in tickets),
                )
                self.counts["waves"] += 1
                wanted = self.LATER_OFFERS
        finally:
            await p2p.shutdown()

    async def _raw(self, host: str, port: int, junk: bool) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except (TimeoutError, OSError):
            self.counts["raw not connected"] += 1
            return
        try:  # the reducer may have closed it already: the transport then refuses writes (RuntimeError)
            if junk:
                writer.write(bytes(256 << 10))
            held = not await closed(reader, 3)
        except (OSError, RuntimeError):
            held = False
        self.counts["raw held" if held else "raw closed by the reducer"] += 1
        with contextlib.suppress(Exception):
            writer.close()

    async def _oversized(self, host: str, port: int, offer) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
            writer.write(offer.ticket + struct.pack(">I", self.OVERSIZED))
            for _ in range(self.OVERSIZED >> 20):
                writer.write(bytes(1 << 20))
                await asyncio.wait_for(writer.drain(), 3)
            await closed(reader, 3)
            self.counts["oversized frames"] += 1
        except (TimeoutError, OSError, RuntimeError):  # closed by the reducer mid-write
            self.counts["oversized frames"] += 1
            self.counts["oversized frames cut short"] += 1
        finally:
            with contextlib.suppress(Exception):
                writer.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_honest_round_averages_while_a_flood_hits_a_reducers_endpoint_and_its_memory_stays_bounded():
    """Two peers average over direct connections while an outsider floods one reducer's endpoint with bare
    connections, junk instead of tickets, more offers than a peer may hold and frames of 16 MiB: the round
    averages, and the reducer's averager process grows by less than 64 MiB from where an honest round left
    it (it would hold the frames, and the junk in every connection's buffer, without the caps)."""
    import psutil

    tensors = peers_tensors(2)
    made, dhts = averagers(
        tensors, build("mean"), [True, True], prefix="direct-flood", min_matchmaking_time=4.0,
        next_chunk_timeout=10.0,
    )  # fmt: skip
    flood, samples, sampling = Flood(made[0], dhts[0]), [], threading.Event()
    reducer = psutil.Process(made[0].pid)

    def sample() -> None:
        while not sampling.wait(0.02):
            samples.append(reducer.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        flood.start()
        assert flood.ready.wait(60) and flood.error is None, flood.error
        for flooded in [False, True]:  # a round before, so that its allocations are in the baseline
            if flooded:
                before = reducer.memory_info().rss
                sampler.start()
                flood.go.set()
            controls = [a.step(wait=False, timeout=40) for a in made]
            deadline = time.monotonic() + 60
            while not all(c.done() for c in controls) and time.monotonic() < deadline:
                time.sleep(0.2)
        while flood.counts["waves"] < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the flood went on at least as long as the round
        sampling.set()
        flood.stop.set()
        flood.join(60)
        sizes = [len(c.result()) if c.done() and not c.exception() else 0 for c in controls]
        out = []
        for a in made:
            with a.get_tensors() as ts:
                out.append([t.clone() for t in ts])
        counts, refusals = [a.transport_counts() for a in made], made[0].direct_refusals()
    finally:
        sampling.set()
        flood.stop.set()
        for a in made:
            a.shutdown()
        for d in dhts:
            d.shutdown()
    growth = max(samples) - before
    print(
        f"reducer RSS {before / 2**20:.0f} MiB before the flood, {max(samples) / 2**20:.0f} MiB at most "
        f"during it (+{growth / 2**20:.1f} MiB, {len(samples)} samples); flood {dict(flood.counts)}; "
        f"refused {refusals}; transport {counts}"
    )
    assert flood.error is None, flood.error
    assert_averaged(out, sizes, tensors)
    assert counts[1]["direct"] == 2  # in both rounds the honest sender reached the flooded reducer directly
    assert flood.counts["waves"] >= 2 and flood.counts["oversized frames"] > 0
    assert refusals["too many tickets for this peer"] > 0 and refusals["a frame over the limit"] > 0
    assert growth < 64 << 20
