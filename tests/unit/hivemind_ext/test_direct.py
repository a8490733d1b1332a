"""The direct TCP path of the all-reduce (cotrain.hivemind_ext.direct).

Here, in the test process alone; the rest in tests/live/test_direct.py and tests/swarm/test_direct.py."""

import asyncio
import struct
import time

import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionInfo, Uniform8BitQuantization
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from cotrain.hivemind_ext.direct import (
    DATA,
    END,
    MAX_FRAME,
    MAX_PENDING,
    MAX_STREAMS_PER_PEER,
    MAX_TICKETS,
    MAX_TICKETS_PER_PEER,
    REDUCER,
    SENDER,
    TICKET_TIMEOUT,
    DirectServer,
    DirectStreamError,
    Seal,
    _incoming,
    frame_limit,
    parse_endpoint,
)
from support.direct import closed


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


@pytest.mark.parametrize("read_ahead_mib, sender_done_early", [(32, True), (1, False), (None, False)])
def test_a_reducer_reads_a_senders_parts_ahead_up_to_its_limit(read_ahead_mib, sender_done_early):
    """24 parts of 1 MiB, more than the connection's buffers hold, to a reducer that averages the first part
    and then waits (for another sender's part, say): within the read-ahead the sender is done at once. By
    default (None) a reducer reads two frames ahead, not 24 MiB."""
    key, part = bytes(32), averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=bytes(1 << 20)))

    async def main():
        received = asyncio.Queue()

        async def reducer(reader, writer):
            limit = {} if read_ahead_mib is None else dict(read_ahead=read_ahead_mib << 20)
            parts = _incoming(reader, Seal(key, REDUCER), **limit)
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


class LoopbackP2P:
    """What a DirectServer asks of its P2P: the peer's addresses (127.0.0.1) and id."""

    peer_id = "reducer"

    async def get_visible_maddrs(self, latest: bool = True):
        return [Multiaddr("/ip4/127.0.0.1/tcp/1")]


async def hold(stream, context):
    """A reducer's handler that takes the first part and keeps the stream open until cancelled."""
    await anext(stream)
    await asyncio.Event().wait()
    yield  # pragma: no cover (never reached)


async def connect(offer, payload: bytes = b"", kept: list | None = None):
    """A connection to the offer's endpoint that presents its ticket, then ``payload``; its writer goes in
    ``kept`` (a writer collected closes its connection)."""
    host, port = parse_endpoint(offer.endpoints[0])
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(offer.ticket + payload)
    if kept is not None:
        kept.append(writer)
    return reader


def first_part(offer) -> bytes:
    return Seal(offer.key, SENDER).seal(DATA, averaging_pb2.AveragingData().SerializeToString())


def test_a_frame_over_four_parts_is_refused_before_it_is_read():
    key = bytes(32)
    # an honest full part: 512 KiB of 8-bit values and their codebook, in its AveragingData, sealed
    values = torch.randn(DEFAULT_PART_SIZE_BYTES)
    part = Uniform8BitQuantization().compress(values, CompressionInfo.from_tensor(values))
    honest = Seal(key, SENDER).seal(DATA, averaging_pb2.AveragingData(tensor_part=part).SerializeToString())
    assert DEFAULT_PART_SIZE_BYTES < len(honest) < DEFAULT_PART_SIZE_BYTES + 2048
    assert MAX_FRAME == frame_limit(DEFAULT_PART_SIZE_BYTES) <= 4 * DEFAULT_PART_SIZE_BYTES + (64 << 10)

    async def main():
        assert (await Seal(key, REDUCER).read(reader_of(honest)))[0] == DATA
        # only the length is read: a 64 MiB frame (the limit before) is refused without waiting for it
        seal = Seal(key, REDUCER)
        with pytest.raises(DirectStreamError, match="at most"):
            await seal.read(reader_of(struct.pack(">I", 1 << 26)))
        assert seal.oversized
        with pytest.raises(DirectStreamError, match="at most"):
            await Seal(key, REDUCER).read(reader_of(struct.pack(">I", MAX_FRAME + 1)))
        # a smaller part size, a smaller limit: the honest part is over 4 parts of 16 KiB
        with pytest.raises(DirectStreamError, match="at most"):
            await Seal(key, REDUCER, frame_limit(2**14)).read(reader_of(honest))

    asyncio.run(main())


def test_tickets_are_capped_per_peer_and_in_all():
    async def main():
        server, kept = DirectServer(LoopbackP2P(), hold), []
        try:
            offers = [await server.offer("flooder") for _ in range(MAX_TICKETS_PER_PEER + 5)]
            assert all(o.ticket and not o.refusal for o in offers[:MAX_TICKETS_PER_PEER])
            assert {o.refusal for o in offers[MAX_TICKETS_PER_PEER:]} == {"too many tickets for this peer"}
            assert server.refused["too many tickets for this peer"] == 5
            assert (await server.offer("honest")).ticket  # another peer still gets its tickets
            for i in range(MAX_TICKETS - MAX_TICKETS_PER_PEER - 1):
                assert (await server.offer(f"peer {i // MAX_TICKETS_PER_PEER}")).ticket
            assert len(server.tickets) == MAX_TICKETS
            assert (await server.offer("newcomer")).refusal == "too many outstanding tickets"
            # a ticket used frees its peer's place
            await connect(offers[0], first_part(offers[0]), kept)
            await asyncio.sleep(0.2)
            assert server.tickets_by_peer["flooder"] == MAX_TICKETS_PER_PEER - 1
            assert (await server.offer("flooder")).ticket
        finally:
            server.close()

    asyncio.run(main())


def test_streams_are_capped_per_peer():
    async def main():
        server, kept = DirectServer(LoopbackP2P(), hold), []
        try:
            offers = [await server.offer("flooder") for _ in range(MAX_STREAMS_PER_PEER + 1)]
            for offer in offers[:MAX_STREAMS_PER_PEER]:
                await connect(offer, first_part(offer), kept)
            await asyncio.sleep(0.3)
            assert server.streams_by_peer["flooder"] == MAX_STREAMS_PER_PEER
            assert (await server.offer("flooder")).refusal == "too many direct streams from this peer"
            # a ticket given before the streams were open: refused all the same, when used
            assert await closed(await connect(offers[-1], first_part(offers[-1]), kept), 2)
            assert server.refused["too many direct streams from this peer"] == 2
            other = await server.offer("honest")
            await connect(other, first_part(other), kept)
            await asyncio.sleep(0.3)
            assert server.streams_by_peer["honest"] == 1 and server.served == MAX_STREAMS_PER_PEER + 1
        finally:
            server.close()

    asyncio.run(main())


def test_a_connection_without_its_ticket_in_time_is_closed_and_an_honest_one_is_quick():
    async def main():
        server, kept = DirectServer(LoopbackP2P(), hold), []
        try:
            offer = await server.offer("honest")
            host, port = parse_endpoint(offer.endpoints[0])
            idle, writer = await asyncio.open_connection(host, port)
            kept.append(writer)
            started = time.monotonic()
            junk, writer = await asyncio.open_connection(host, port)
            kept.append(writer)
            writer.write(bytes(1 << 20))  # no ticket: 16 bytes are read, the rest never
            assert await closed(junk, 2)
            assert server.refused["unknown or expired ticket"] == 1
            await connect(offer, first_part(offer), kept)
            assert await closed(idle, TICKET_TIMEOUT + 1)
            waited = time.monotonic() - started
            assert TICKET_TIMEOUT - 0.1 < waited < TICKET_TIMEOUT + 0.5, waited
            assert server.refused["no ticket in time"] == 1 and server.served == 1
            print(f"an honest sender's ticket came {server.slowest_ticket * 1e3:.2f} ms after its accept")
            assert server.slowest_ticket < 0.1
        finally:
            server.close()

    asyncio.run(main())


def test_too_many_connections_without_a_ticket_close_the_oldest_and_an_honest_one_is_served():
    async def main():
        server, kept = DirectServer(LoopbackP2P(), hold), []
        try:
            offer = await server.offer("honest")
            host, port = parse_endpoint(offer.endpoints[0])
            idle = []
            for _ in range(MAX_PENDING + 1):
                reader, writer = await asyncio.open_connection(host, port)
                idle.append(reader)
                kept.append(writer)
            assert await closed(idle[0], 0.5)  # the oldest, long before its ticket's time is up
            assert not any(await asyncio.gather(*(closed(r, 0.05) for r in idle[1:])))
            assert server.refused["too many connections without a ticket"] == 1
            assert len(server.pending) == MAX_PENDING
            await connect(offer, first_part(offer), kept)
            await asyncio.sleep(0.3)
            assert server.served == 1 and server.streams == 1
            assert all(await asyncio.gather(*(closed(r, TICKET_TIMEOUT + 1) for r in idle[1:])))
            assert server.pending == {}
        finally:
            server.close()

    asyncio.run(main())
