"""The direct TCP path of the all-reduce (cotrain.swarm.direct): sealed frames, tickets, live all-reduces
over it, and the fall-back to libp2p."""

import asyncio
import time

import pytest
import torch
from hivemind.proto import averaging_pb2, runtime_pb2

from cotrain.swarm.direct import (
    DATA,
    END,
    REDUCER,
    SENDER,
    TICKET_BYTES,
    DirectServer,
    DirectStreamError,
    Seal,
    _incoming,
    parse_endpoint,
)
from cotrain.swarm.robust import Aggregation
from test_robust import averagers


def reader_of(*frames: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for frame in frames:
        reader.feed_data(frame)
    reader.feed_eof()
    return reader


def test_sealed_frames_read_back_in_order_and_refuse_tampering_replay_and_the_wrong_key():
    key = bytes(range(32))

    async def main():
        sender, reducer = Seal(key, SENDER), Seal(key, REDUCER)
        frames = [sender.seal(DATA, b"part 1"), sender.seal(DATA, b"part 2"), sender.seal(END)]
        got = [await reducer.read(r) for r in [reader_of(b"".join(frames))] * 3]
        assert got == [(DATA, b"part 1"), (DATA, b"part 2"), (END, b"")]

        tampered = bytearray(Seal(key, SENDER).seal(DATA, b"x" * 100))
        tampered[20] ^= 1
        with pytest.raises(DirectStreamError, match="authentication"):
            await Seal(key, REDUCER).read(reader_of(bytes(tampered)))

        first = Seal(key, SENDER).seal(DATA, b"once")
        again = Seal(key, REDUCER)
        assert await again.read(reader_of(first)) == (DATA, b"once")
        with pytest.raises(DirectStreamError, match="authentication"):  # replayed: the counter moved on
            await again.read(reader_of(first))

        with pytest.raises(DirectStreamError, match="authentication"):  # a frame sent back to its sender
            await Seal(key, SENDER).read(reader_of(Seal(key, SENDER).seal(DATA, b"echo")))
        with pytest.raises(DirectStreamError, match="authentication"):
            await Seal(bytes(32), REDUCER).read(reader_of(Seal(key, SENDER).seal(DATA, b"other key")))
        with pytest.raises(DirectStreamError, match="closed before its end"):
            await Seal(key, REDUCER).read(reader_of(Seal(key, SENDER).seal(DATA, b"cut")[:-3]))

    asyncio.run(main())


@pytest.mark.parametrize("read_ahead_mib, sender_done_early", [(32, True), (1, False)])
def test_a_reducer_reads_a_senders_parts_ahead_up_to_its_limit(read_ahead_mib, sender_done_early):
    """24 parts of 1 MiB, more than the connection's buffers hold, to a reducer that averages the first part
    and then waits (for another sender's part, say): within the read-ahead the sender is done at once."""
    key, part = bytes(32), averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=bytes(1 << 20)))

    async def main():
        received = asyncio.Queue()

        async def reducer(reader, writer):
            parts = _incoming(reader, Seal(key, REDUCER), read_ahead=read_ahead_mib << 20)
            await received.put(await anext(parts))
            await asyncio.sleep(2.0)  # waiting for another sender's part
            async for message in parts:
                await received.put(message)
            writer.close()

        server = await asyncio.start_server(reducer, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        seal = Seal(key, SENDER)
        for _ in range(24):
            writer.write(seal.seal(DATA, part.SerializeToString()))
        writer.write(seal.seal(END))
        started = time.monotonic()
        await writer.drain()
        sent_in = time.monotonic() - started
        got = [await asyncio.wait_for(received.get(), 10) for _ in range(24)]
        assert all(len(m.tensor_part.buffer) == 1 << 20 for m in got)
        writer.close()
        server.close()
        return sent_in

    sent_in = asyncio.run(main())
    assert (sent_in < 1.5) == sender_done_early, sent_in


def test_endpoints_parse_only_as_ip_and_port():
    assert parse_endpoint("127.0.0.1 4242") == ("127.0.0.1", 4242)
    assert parse_endpoint("::1 80") == ("::1", 80)
    assert parse_endpoint("example.com 80") is None
    assert parse_endpoint("127.0.0.1") is None
    assert parse_endpoint("127.0.0.1 port") is None


def test_a_connection_without_a_valid_ticket_is_closed_unserved():
    from hivemind.p2p import P2P

    async def main():
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        served = []

        async def handler(stream, context):
            served.append(context.remote_id)
            yield  # pragma: no cover (never reached)

        server = DirectServer(p2p, handler)
        try:
            offer = await server.offer(p2p.peer_id)
            assert offer.endpoints and len(offer.ticket) == TICKET_BYTES and len(offer.key) == 32
            host, port = parse_endpoint(offer.endpoints[0])
            assert host == "127.0.0.1"
            for ticket in [bytes(TICKET_BYTES), offer.ticket[::-1]]:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(ticket + Seal(offer.key, SENDER).seal(END))
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing said
                writer.close()
            assert served == [] and offer.ticket in server.tickets
        finally:
            server.close()
            await p2p.shutdown()

    asyncio.run(main())


# --- live all-reduces on 127.0.0.1 ---------------------------------------------------------------------


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
        Aggregation("mean"),
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
@pytest.mark.timeout(300)
def test_three_peers_average_over_direct_connections():
    tensors = peers_tensors(3)
    out, sizes, counts = run_round(tensors, [True, True, True])
    assert_averaged(out, sizes, tensors)
    # each peer sent to the 2 other reducers directly and served the 2 others' streams
    assert counts == [{"direct": 2, "libp2p": 0, "served": 2}] * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_without_the_direct_path_averages_over_libp2p_with_the_others():
    tensors = peers_tensors(3)
    out, sizes, counts = run_round(tensors, [True, True, False])
    assert_averaged(out, sizes, tensors)
    # the two direct peers reach each other directly; the third refuses offers, so they reach it over
    # libp2p, and it sends over libp2p only
    assert counts[0] == counts[1] == {"direct": 1, "libp2p": 1, "served": 1}
    assert counts[2] == {"direct": 0, "libp2p": 0, "served": 0}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_offer_naming_another_address_than_libp2p_reaches_is_not_dialled(monkeypatch):
    import cotrain.swarm.direct as direct

    # every reducer names an address its peers' libp2p connections do not use (the averagers are forked:
    # they inherit the patch); senders must not dial it and send over libp2p instead
    monkeypatch.setattr(direct, "endpoint", lambda ip, port: f"192.0.2.1 {port}")
    tensors = peers_tensors(2)
    out, sizes, counts = run_round(tensors, [True, True])
    assert_averaged(out, sizes, tensors)
    assert counts == [{"direct": 0, "libp2p": 1, "served": 0}] * 2
