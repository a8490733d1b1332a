"""A direct TCP path for the all-reduce's parts between peers that can reach each other.

hivemind sends every part of an all-reduce over libp2p: the Python process hands it to its ``p2pd`` daemon
through a Unix socket, the daemon multiplexes it with yamux over one Noise-encrypted TCP connection per pair
of peers, and the other daemon hands it on to its Python process. On shaped links that transport alone
leaves them a fifth to a third idle at 4 and 8 peers, where plain TCP between the same processes reaches
1.06-1.13 x the bandwidth bound (docs/benchmarks.md, all-reduce).

Here a sender opens each all-reduce stream to a reducer as its own TCP connection between the two averager
processes, negotiated over libp2p:

1. The sender asks the reducer for an offer (``rpc_direct_offer``, an averager RPC: in a private swarm it
   is admitted, like every averaging request, only from a peer that proved its access token). The reducer
   answers with the TCP endpoints its averager process listens on, a one-time ticket and a fresh key, all
   carried inside the authenticated, encrypted libp2p stream, and remembers the ticket for the sender's peer
   id.
2. The sender connects to the endpoint whose address is the one its libp2p connection to that peer uses
   (never to another address the reducer names), sends the ticket, and the stream runs as the libp2p one
   would: the sender's ``AveragingData`` messages one way, the reducer's the other, at once. The reducer
   runs its usual ``rpc_aggregate_part`` on it with the peer id the ticket was issued to.
3. Every frame is sealed with AES-GCM under the offer's key (a counter nonce per direction): a frame that was
   altered, replayed or reordered ends the stream, which hivemind's all-reduce handles as any broken stream.

A peer that does not answer offers (hivemind's averagers, a cotrain peer with ``--no-direct-allreduce``), an
endpoint that cannot be reached within ``CONNECT_TIMEOUT`` (a firewall, NAT, a relayed connection) or a
refused ticket: the stream goes over libp2p as before, and the peer is not tried directly again for
``UNREACHABLE_SECONDS``. Client-mode peers answer no offers (they accept no connections) but send their parts
directly to reducers they can reach.

Caps (the reasons: docs/security.md), so that neither whoever reaches the endpoint nor a peer admitted to the
averager's RPCs makes its process hold much memory or many sockets:
- a frame is at most ``frame_limit(part_size_bytes)``: ``FRAME_PARTS`` (4) parts + ``FRAME_SLACK`` (64 KiB),
  2 MiB + 64 KiB at hivemind's 512 KiB part (``MAX_FRAME``); a stream is read ahead up to
  ``READ_AHEAD_FRAMES`` (2) frames' bytes, through a connection buffer of one part (~12 MiB a stream at most);
- tickets outstanding: ``MAX_TICKETS_PER_PEER`` (64) a peer id, ``MAX_TICKETS`` in all; streams at once:
  ``MAX_STREAMS_PER_PEER`` (16) a peer id, ``MAX_STREAMS`` (128) in all; an offer beyond is refused (libp2p);
- connections without a ticket: ``MAX_PENDING`` (128), one more closes the oldest; each is closed unless its
  ticket comes within ``TICKET_TIMEOUT`` (1 s), and only the ticket's 16 bytes are read before, from the
  bare socket. An honest sender's ticket comes with its first packet and is read at its accept.
Each refusal is counted by reason (``DirectServer.refused``, ``DirectTransport.direct_refusals``) and logged
at debug level once per peer id (an address before its ticket) and reason; the reducer goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import secrets
import socket
import struct
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from cotrain.hivemind_ext.hooks import Averager

logger = logging.getLogger(__name__)

TICKET_BYTES = 16
KEY_BYTES = 32
TICKET_SECONDS = 30.0  # an offer's ticket not used within this is forgotten
MAX_TICKETS = 4096  # outstanding tickets of one averager, all peers together; offers beyond are refused
MAX_TICKETS_PER_PEER = 64  # outstanding tickets for one peer id; its offers beyond are refused
MAX_STREAMS_PER_PEER = 16  # direct streams served at once to one peer id; offers, connections beyond refused
MAX_STREAMS = 128  # direct streams served at once, all peers together; offers, connections beyond refused
MAX_PENDING = 128  # accepted connections without a ticket yet; one more closes the oldest of them
TICKET_TIMEOUT = 1.0  # seconds a reducer waits for an accepted connection's ticket
LISTEN_BACKLOG = 128  # connections the kernel holds that the reducer has not accepted yet
ACCEPT_PAUSE = 0.1  # seconds a reducer waits after accept() failed (out of file descriptors) before again
CONNECT_TIMEOUT = 2.0  # seconds to open the TCP connection and hand over the ticket
OFFER_TIMEOUT = 3.0  # seconds for the reducer's offer over libp2p
UNREACHABLE_SECONDS = 600.0  # a peer not reached directly is not tried directly again for this long
FRAME_PARTS = 4  # a frame holds at most this many all-reduce parts' bytes (see the module's doc)
FRAME_SLACK = 1 << 16  # and this much more: protobuf fields, a quantization's codebook, the seal
READ_AHEAD_FRAMES = 2  # a stream's bytes read ahead of the averaging (that waits for every sender's part k)
MAX_LOGGED_REFUSERS = 1024  # peers and addresses whose refusals are logged (once); later ones only counted


def frame_limit(part_size_bytes: int = DEFAULT_PART_SIZE_BYTES) -> int:
    """The largest sealed frame of an all-reduce whose parts are of ``part_size_bytes``."""
    return FRAME_PARTS * part_size_bytes + FRAME_SLACK


MAX_FRAME = frame_limit()  # at hivemind's part of 512 KiB: 2 MiB + 64 KiB
DATA, END, ERROR = 0, 1, 2  # kinds of frame
SENDER, REDUCER = 0, 1  # the two ends of a stream (the nonce's first byte: one key, two directions)


class DirectStreamError(ConnectionError):
    """A direct stream broke (closed early, a frame that failed authentication) or the reducer failed."""


@functools.cache
def messages():
    """The offer RPC's two protobuf messages, built at first use from a descriptor."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="cotrain_direct.proto", package="cotrain", syntax="proto3")
    fdp.message_type.add(name="DirectRequest")
    offer = fdp.message_type.add(name="DirectOffer")
    offer.field.add(name="endpoints", number=1, type=f.TYPE_STRING, label=f.LABEL_REPEATED)
    offer.field.add(name="ticket", number=2, type=f.TYPE_BYTES, label=f.LABEL_OPTIONAL)
    offer.field.add(name="key", number=3, type=f.TYPE_BYTES, label=f.LABEL_OPTIONAL)
    offer.field.add(name="refusal", number=4, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"cotrain.{name}"))
        for name in ("DirectRequest", "DirectOffer")
    )


DirectRequest, DirectOffer = messages()


class Seal:
    """One end of a direct stream: frames sealed with AES-GCM under the stream's key, a counter nonce per
    direction (so a frame cannot be altered, dropped, replayed or moved without the next one failing)."""

    def __init__(self, key: bytes, side: int, max_frame: int = MAX_FRAME) -> None:
        self.aead = AESGCM(key)
        self.side, self.max_frame = side, max_frame
        self.sent = self.received = 0
        self.oversized = False  # a frame over max_frame came (and ended the stream)

    def _nonce(self, side: int, counter: int) -> bytes:
        return bytes([side, 0, 0, 0]) + counter.to_bytes(8, "big")

    def seal(self, kind: int, payload: bytes = b"") -> bytes:
        box = self.aead.encrypt(self._nonce(self.side, self.sent), bytes([kind]) + payload, None)
        self.sent += 1
        return struct.pack(">I", len(box)) + box

    async def read(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        try:
            (size,) = struct.unpack(">I", await reader.readexactly(4))
            if size > self.max_frame:
                self.oversized = True
                raise DirectStreamError(f"a direct frame of {size} bytes (at most {self.max_frame})")
            box = await reader.readexactly(size)
        except asyncio.IncompleteReadError as e:
            raise DirectStreamError("the direct stream closed before its end") from e
        try:
            plain = self.aead.decrypt(self._nonce(1 - self.side, self.received), box, None)
        except InvalidTag as e:
            raise DirectStreamError("a direct frame failed authentication") from e
        self.received += 1
        return plain[0], plain[1:]


def _fast(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


def _ips(maddrs) -> list[str]:
    """The IP addresses (ip4, ip6) in a list of multiaddrs, in order, without repeats."""
    found = []
    for maddr in maddrs:
        for proto in ("ip4", "ip6"):
            with contextlib.suppress(Exception):
                ip = maddr.value_for_protocol(proto)
                if ip and ip not in found:
                    found.append(ip)
    return found


def endpoint(ip: str, port: int) -> str:
    return f"{ip} {port}"


def parse_endpoint(text: str) -> tuple[str, int] | None:
    try:
        ip, port = text.split(" ")
        return str(ipaddress.ip_address(ip)), int(port)
    except ValueError:
        return None


class DirectServer:
    """The listening end, in an averager process: offers tickets and serves the streams that present them
    with ``handler`` (the averager's ``rpc_aggregate_part``), within the caps of the module's doc."""

    def __init__(self, p2p: P2P, handler: Callable, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES) -> None:
        self.p2p, self.handler = p2p, handler
        self.max_frame, self.buffer = frame_limit(part_size_bytes), part_size_bytes + FRAME_SLACK
        self.endpoints: list[str] = []
        self.tickets: dict[bytes, tuple[PeerID, bytes, float]] = {}
        self.tickets_by_peer: Counter[PeerID] = Counter()
        self.streams_by_peer: Counter[PeerID] = Counter()
        self.pending: dict[socket.socket, asyncio.Task] = {}  # connections without a ticket yet, oldest first
        self.streams = 0  # served now
        self.served = 0  # streams served directly
        self.refused: Counter[str] = Counter()  # offers and connections refused, by reason
        self.slowest_ticket = 0.0  # seconds from accepting a connection to its ticket, the longest seen
        self._logged: set[tuple[str, str]] = set()
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._started: asyncio.Future | None = None

    async def start(self) -> None:
        """Listen on each IP address the peer's libp2p daemon listens on (a free port on each)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        own = await self.p2p.get_visible_maddrs(latest=True)
        for ip in _ips(own):
            address = ipaddress.ip_address(ip)
            if address.is_unspecified:
                continue
            family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            try:
                listener = socket.create_server((ip, 0), family=family, backlog=LISTEN_BACKLOG)
            except OSError as e:  # an announced address that is not this machine's
                logger.debug(f"Direct all-reduce: cannot listen on {ip}: {e}")
                continue
            listener.setblocking(False)
            self._listeners.append(listener)
            self._spawn(self._accept(listener))
            self.endpoints.append(endpoint(ip, listener.getsockname()[1]))
        logger.debug(f"Direct all-reduce: listening on {self.endpoints}")

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _refuse(self, who: object, reason: str) -> None:
        """Count a refusal; log it at debug level the first time for this peer (or address) and reason."""
        self.refused[reason] += 1
        key = (str(who), reason)
        if key not in self._logged and len(self._logged) < MAX_LOGGED_REFUSERS:
            self._logged.add(key)
            logger.debug(f"Direct all-reduce: refused {who}: {reason} (counted, not logged again)")

    async def offer(self, peer: PeerID):
        await self.start()
        now = time.monotonic()
        for ticket in [t for t, (_, _, deadline) in self.tickets.items() if deadline < now]:
            self._forget(ticket)
        if not self.endpoints:
            return DirectOffer(refusal="no address to listen on")
        for full, reason in [
            (len(self.tickets) >= MAX_TICKETS, "too many outstanding tickets"),
            (self.tickets_by_peer[peer] >= MAX_TICKETS_PER_PEER, "too many tickets for this peer"),
            (self.streams_by_peer[peer] >= MAX_STREAMS_PER_PEER, "too many direct streams from this peer"),
            (self.streams >= MAX_STREAMS, "too many direct streams"),
        ]:
            if full:
                self._refuse(peer, reason)
                return DirectOffer(refusal=reason)
        ticket, key = secrets.token_bytes(TICKET_BYTES), AESGCM.generate_key(bit_length=8 * KEY_BYTES)
        self.tickets[ticket] = (peer, key, now + TICKET_SECONDS)
        self.tickets_by_peer[peer] += 1
        return DirectOffer(endpoints=self.endpoints, ticket=ticket, key=key)

    def _forget(self, ticket: bytes) -> tuple[PeerID, bytes, float] | None:
        entry = self.tickets.pop(ticket, None)
        if entry is not None:
            _decrement(self.tickets_by_peer, entry[0])
        return entry

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while listener.fileno() != -1:
            try:
                connection, address = await loop.sock_accept(listener)
            except OSError as e:  # out of file descriptors, say: the connections served go on
                self._refuse("the listening socket", f"accept failed ({e.strerror or e!r})")
                await asyncio.sleep(ACCEPT_PAUSE)
                continue
            if len(self.pending) >= MAX_PENDING:
                oldest = next(iter(self.pending))
                self.pending.pop(oldest).cancel()  # its own task closes it
                self._refuse(address[0], "too many connections without a ticket")
            connection.setblocking(False)
            task = self._spawn(self._serve(connection, address[0]))
            task.add_done_callback(lambda _, c=connection: c.close())  # also when cancelled before it ran
            self.pending[connection] = task
            await asyncio.sleep(0)  # the connections accepted read their tickets before the next accept

    async def _serve(self, connection: socket.socket, host: str) -> None:
        try:
            accepted = time.monotonic()
            try:
                ticket = await asyncio.wait_for(_receive(connection, TICKET_BYTES), TICKET_TIMEOUT)
            except TimeoutError:
                return self._refuse(host, "no ticket in time")
            except (ConnectionError, OSError):
                return self._refuse(host, "closed before its ticket")
            finally:
                self.pending.pop(connection, None)
            self.slowest_ticket = max(self.slowest_ticket, time.monotonic() - accepted)
            entry = self._forget(ticket)
            if entry is None or entry[2] < time.monotonic():
                return self._refuse(host, "unknown or expired ticket")  # nothing is said to whoever this is
            peer, key, _ = entry
            if self.streams_by_peer[peer] >= MAX_STREAMS_PER_PEER:
                return self._refuse(peer, "too many direct streams from this peer")
            if self.streams >= MAX_STREAMS:
                return self._refuse(peer, "too many direct streams")
            self.streams += 1
            self.streams_by_peer[peer] += 1
            try:
                reader, writer = await asyncio.open_connection(sock=connection, limit=self.buffer)
                await self._stream(reader, writer, peer, key)
            finally:
                self.streams -= 1
                _decrement(self.streams_by_peer, peer)
        except Exception as e:  # one connection's end, never the reducer's
            logger.debug(f"Direct all-reduce: a connection from {host} failed: {e!r}")
        finally:
            connection.close()  # (closed already when a stream ran: then a no-op)

    async def _stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: PeerID, key: bytes
    ) -> None:
        _fast(writer)
        seal = Seal(key, REDUCER, self.max_frame)
        context = P2PContext(handle_name="cotrain.direct", local_id=self.p2p.peer_id, remote_id=peer)
        self.served += 1
        incoming = _incoming(reader, seal, READ_AHEAD_FRAMES * self.max_frame)
        try:
            async for message in self.handler(incoming, context):
                writer.write(seal.seal(DATA, message.SerializeToString()))
                await writer.drain()
            writer.write(seal.seal(END))
            await writer.drain()
        except Exception as e:
            logger.debug(f"Direct all-reduce: stream from {peer} failed: {e!r}")
            with contextlib.suppress(Exception):
                writer.write(seal.seal(ERROR, repr(e).encode()))
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                await incoming.aclose()  # stops its reading ahead
            await _close(writer)
            if seal.oversized:
                self._refuse(peer, "a frame over the limit")

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for listener in self._listeners:
            listener.close()


def _decrement(counter: Counter, key) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


async def _receive(connection: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from a bare non-blocking socket, never more."""
    loop, data = asyncio.get_running_loop(), b""
    while len(data) < size:
        chunk = await loop.sock_recv(connection, size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


async def _incoming(
    reader: asyncio.StreamReader, seal: Seal, read_ahead: int = READ_AHEAD_FRAMES * MAX_FRAME
) -> AsyncIterator:
    """The sender's messages on the reducer's side, until the sender's end of stream. Frames are read from
    the connection as they come, up to ``read_ahead`` bytes before the reducer takes them: a sender whose
    part k+1 waits for another sender's part k keeps its link busy meanwhile."""
    frames: asyncio.Queue = asyncio.Queue()
    room = asyncio.Event()
    buffered = 0

    async def read() -> None:
        nonlocal buffered
        try:
            while True:
                kind, payload = await seal.read(reader)
                buffered += len(payload)
                frames.put_nowait((kind, payload))
                if kind != DATA:
                    return
                while buffered > read_ahead:
                    room.clear()
                    await room.wait()
        except Exception as e:
            frames.put_nowait((None, e))

    task = asyncio.create_task(read())
    try:
        while True:
            kind, payload = await frames.get()
            if kind is None:
                raise payload
            buffered -= len(payload)
            room.set()
            if kind == END:
                return
            if kind != DATA:
                raise DirectStreamError(f"a direct frame of unexpected kind {kind}")
            yield averaging_pb2.AveragingData.FromString(payload)
    finally:
        task.cancel()


class DirectClient:
    """The sending end, in an averager process: opens all-reduce streams directly where the reducer offers
    it and its endpoint can be reached, over libp2p otherwise. Counts the streams opened each way."""

    def __init__(self, p2p: P2P, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES) -> None:
        self.p2p = p2p
        self.max_frame = frame_limit(part_size_bytes)  # of the reducers' replies
        self.unreachable: dict[PeerID, float] = {}
        self.direct = self.libp2p = 0

    async def open(self, stub, peer: PeerID, inputs: AsyncIterator):
        """``stub.rpc_aggregate_part(inputs)``, over a direct connection when one can be made."""
        opened = None
        if self.unreachable.get(peer, 0.0) <= time.monotonic():
            opened = await self._connect(stub, peer)
        if opened is None:
            self.libp2p += 1
            return await stub.rpc_aggregate_part(inputs)
        self.direct += 1
        return _exchange(*opened, inputs)

    async def _connect(self, stub, peer: PeerID):
        try:
            offer = await stub.rpc_direct_offer(DirectRequest(), timeout=OFFER_TIMEOUT)
            if offer.refusal:
                raise DirectStreamError(offer.refusal)
            ips = set()
            for info in await self.p2p.list_peers():
                if info.peer_id == peer:
                    ips.update(_ips(info.addrs))
            targets = [e for e in map(parse_endpoint, offer.endpoints) if e is not None and e[0] in ips]
            if not targets:
                raise DirectStreamError(f"none of {list(offer.endpoints)} is where libp2p reaches it ({ips})")
            last: Exception | None = None
            for host, port in targets:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(host, port, limit=self.max_frame), CONNECT_TIMEOUT
                    )
                except (TimeoutError, OSError) as e:
                    last = e
                    continue
                _fast(writer)
                writer.write(offer.ticket)
                return reader, writer, Seal(offer.key, SENDER, self.max_frame)
            raise DirectStreamError(f"cannot connect to {targets}: {last!r}")
        except Exception as e:  # anything at all: the stream goes over libp2p
            logger.debug(f"Direct all-reduce: {peer} not reached directly ({e!r}); libp2p instead")
            self.unreachable[peer] = time.monotonic() + UNREACHABLE_SECONDS
            return None


def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seal: Seal, inputs: AsyncIterator
) -> AsyncIterator:
    """The sender's messages out (starting now, as a libp2p stream starts sending when opened: a client-mode
    sender waits until all its parts are sent before it reads) and the reducer's back, at once."""

    async def send() -> None:
        try:
            async for message in inputs:
                writer.write(seal.seal(DATA, message.SerializeToString()))
                await writer.drain()
            writer.write(seal.seal(END))
            await writer.drain()
        except Exception:
            writer.transport.abort()  # the reading end then fails too, and says so
            raise

    return _replies(reader, writer, seal, asyncio.create_task(send()))


async def _replies(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seal: Seal, sending: asyncio.Task
) -> AsyncIterator:
    try:
        while True:
            kind, payload = await seal.read(reader)
            if kind == END:
                return
            if kind == ERROR:
                raise DirectStreamError(f"the reducer failed: {payload.decode(errors='replace')}")
            if kind != DATA:
                raise DirectStreamError(f"a direct frame of unexpected kind {kind}")
            yield averaging_pb2.AveragingData.FromString(payload)
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sending
        await _close(writer)


# each averager process's DirectClient, by its P2P (an averager's all-reduce runner reaches the averager only
# through the P2P and the averager's class: ``type(averager).get_stub(p2p, peer)``)
_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _DirectStub:
    """Another peer's averager stub: its all-reduce streams go through a DirectClient, the rest as is."""

    def __init__(self, stub, client: DirectClient, peer: PeerID) -> None:
        self._libp2p_stub, self._direct_client, self._remote = stub, client, peer

    def __getattr__(self, name: str):
        return getattr(self._libp2p_stub, name)

    async def rpc_aggregate_part(self, inputs):
        return await self._direct_client.open(self._libp2p_stub, self._remote, inputs)


class DirectTransport(Averager):
    """For a hivemind DecentralizedAverager subclass (put it first among the bases): its all-reduce streams to
    other reducers go over direct connections where they can (``direct``, on by default), and it answers other
    peers' offer requests. Runs in the averager's process."""

    def __init__(self, *args, direct: bool = True, **kwargs) -> None:
        self.direct = direct  # before hivemind's __init__, which may start the averager's process
        super().__init__(*args, **kwargs)

    @classmethod
    def get_stub(cls, p2p: P2P, peer: PeerID, *, namespace: str | None = None):
        stub = super().get_stub(p2p, peer, namespace=namespace)
        client = _CLIENTS.get(p2p)
        return stub if client is None else _DirectStub(stub, client, peer)

    async def rpc_direct_offer(self, request: DirectRequest, context: P2PContext) -> DirectOffer:
        """Another peer asks to send its all-reduce parts over a direct connection."""
        if not self.direct:
            return DirectOffer(refusal="direct all-reduce is off")
        if getattr(self, "_direct_server", None) is None:
            self._direct_server = DirectServer(self.p2p, self.rpc_aggregate_part, self._part_size_bytes())
        return await self._direct_server.offer(context.remote_id)

    def _direct_ready(self) -> None:
        """Before an all-reduce: this process's streams go through a DirectClient (when ``direct``)."""
        if self.direct and self.p2p not in _CLIENTS:
            _CLIENTS[self.p2p] = DirectClient(self.p2p, self._part_size_bytes())

    def _part_size_bytes(self) -> int:
        return getattr(self, "allreduce_kwargs", {}).get("part_size_bytes", DEFAULT_PART_SIZE_BYTES)

    async def run_allreduce(self, *args, **kwargs):
        self._direct_ready()
        return await super().run_allreduce(*args, **kwargs)

    def transport_counts(self) -> dict:
        """All-reduce streams this averager opened directly and over libp2p, and served directly."""
        future = MPFuture()
        self.ask_serving_loop("_transport_counts", future=future)
        return future.result()

    async def _transport_counts(self, future: MPFuture) -> None:
        client, server = _CLIENTS.get(self.p2p), getattr(self, "_direct_server", None)
        future.set_result(
            {
                "direct": client.direct if client else 0,
                "libp2p": client.libp2p if client else 0,
                "served": server.served if server else 0,
            }
        )

    def direct_refusals(self) -> dict:
        """Offers and connections this averager's direct server refused, by reason, and the longest it
        waited for an accepted connection's ticket (``slowest_ticket``, seconds)."""
        future = MPFuture()
        self.ask_serving_loop("_direct_refusals", future=future)
        return future.result()

    async def _direct_refusals(self, future: MPFuture) -> None:
        server = getattr(self, "_direct_server", None)
        future.set_result({**server.refused, "slowest_ticket": server.slowest_ticket} if server else {})
