"""Reachability, measured: can other peers dial this one? A peer asks an initial peer to dial it back.

A peer behind NAT that announces itself as a full peer breaks others' rounds (they are given parts it cannot
be sent), and one that cannot be dialed cannot reduce anything. So a trainer started without
``--client-mode`` finds out before it joins (``dial_back``): it starts a short-lived libp2p host on the
addresses it will listen on and announce, connects to an initial peer, and asks it to dial those addresses
back (``DIAL_BACK_HANDLE``). The initial peer answers from a host of its own, made for the one dial (a new
identity, dial-only, no relay): a new connection, never the one the asking peer opened. Reached: the peer
joins as a full peer. Not reached: it joins as a client and says why. No answer within the time limit (an
older version): it assumes it is public, as before, and says so; answers that stay "busy" until then: it
joins as a client (the safe side), and says so. Petals checks its servers' reachability the same way.

The probe dials only the asker, as libp2p's AutoNAT does: the IP address its connection to the answering
peer came from, on TCP, at the ports of the addresses it names (at most ``MAX_PORTS``); never a name, never
another host, and the dial must reach the asker's own id (libp2p authenticates it). The answer is reached
or not reached, with no error text (which would tell open, closed and filtered ports apart). The request is
hostile until checked: at most ``MAX_ADDRESSES`` addresses of ``MAX_ADDRESS_CHARS`` characters, each a
parsable multiaddr; one answered request per asking peer every ``REQUEST_EVERY`` seconds; one dial at a
time per asking IP address, at most ``MAX_DIALS`` at once and ``DIALS_PER_MINUTE`` a minute over all askers,
beyond which a request is answered "busy" at once (never queued: the asker asks again every ``BUSY_RETRY``
seconds until its time limit). Identities are free, addresses are not: many identities on one address hold
one dial at a time. In a private swarm
the probe is served to holders of a valid token only, who prove they hold its key (a signature over both
peers' ids, the time and a nonce: cotrain.access.possession).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Any

from hivemind.p2p import P2P, PeerID

from cotrain.access import possession
from cotrain.access.wire import build_messages
from cotrain.faults import unreachable_addresses
from cotrain.hivemind_ext.hooks import p2p_client
from cotrain.hivemind_ext.unexported import Multiaddr

logger = logging.getLogger(__name__)

DIAL_BACK_HANDLE = "cotrain.DialBack"  # answered by every full peer
DIAL_TIMEOUT = 5.0  # seconds the answering peer's dial may take
ASK_TIMEOUT = DIAL_TIMEOUT + 10.0  # seconds an asking peer waits for an answer, busy ones retried
BUSY_RETRY = 1.0  # seconds before an asking peer asks again after a busy answer
MAX_ADDRESSES = 8
MAX_ADDRESS_CHARS = 200
MAX_PORTS = 4  # ports of one request dialed
REQUEST_EVERY = 10.0  # seconds between two requests of one asking peer that are answered
MAX_DIALS = 4  # dials in flight at once, over all askers
DIALS_PER_MINUTE = 60  # dials started a minute, over all askers
PURPOSE = "cotrain-dial-back/1"  # what a private swarm's request proves its token key for
MAX_DETAIL = 200  # characters of an answer's detail read
NOT_REACHED = "not reached"  # the whole detail of an answer that could not dial the asker
BUSY = "busy"  # the detail of an answer that refused at once: too many requests in flight


@functools.cache
def messages():
    """The dial-back request and answer, built at first use from a descriptor."""

    return build_messages(
        "cotrain_dialback.proto",
        {
            # newline-separated multiaddrs, without /p2p (only their TCP ports are used); in a private swarm
            # the asker's token and its proof of holding the token's key (cotrain.access.possession)
            "DialBackRequest": [
                ("addresses", "string"),
                ("token", "bytes"),
                ("time", "double"),
                ("nonce", "bytes"),
                ("signature", "bytes"),
            ],
            "DialBackReply": [("reached", "bool"), ("detail", "string")],
        },
    )


@dataclasses.dataclass(frozen=True)
class Reachability:
    """What the dial-back probe found: ``reached`` True (others can dial this peer), False (they cannot), None
    (nobody answered); ``peer``: the initial peer that answered; ``addresses``: those it was asked to dial;
    ``detail``: its answer's detail; ``connected``: whether an initial peer could be connected to at all;
    ``busy``: whether every answer was "busy" (too many requests at the answering peers)."""

    reached: bool | None
    peer: str = ""
    addresses: tuple[str, ...] = ()
    detail: str = ""
    connected: bool = False
    busy: bool = False


def checked_ports(text: str) -> list[int]:
    """The TCP ports of a dial-back request's addresses (at most MAX_PORTS, in their order), or ValueError
    (see the module's doc). Their hosts are ignored: the probe dials the asker's own IP address."""
    lines = [line for line in text.split("\n") if line]
    if not lines or len(lines) > MAX_ADDRESSES:
        raise ValueError(f"between 1 and {MAX_ADDRESSES} addresses, got {len(lines)}")
    ports: list[int] = []
    for line in lines:
        if len(line) > MAX_ADDRESS_CHARS:
            raise ValueError("an address longer than the limit")
        items = [(p.name, value) for p, value in Multiaddr(line).items()]
        names = [name for name, _ in items]
        if "p2p" in names or "p2p-circuit" in names:
            raise ValueError(f"a relayed or peer-qualified address: {line}")
        if len(items) >= 2 and items[1][0] == "tcp" and int(items[1][1]) not in ports:
            ports.append(int(items[1][1]))
    if not ports:
        raise ValueError("no TCP address to dial")
    return ports[:MAX_PORTS]


def asker_host(peers: list[Any], asker: Any) -> tuple[str, str] | None:
    """("ip4" or "ip6", address) of the direct connection of ``asker`` among the daemon's ``peers``
    (hivemind PeerInfo: a connection's remote address each), or None (relayed, or gone)."""
    for info in peers:
        if info.peer_id != asker:
            continue
        for address in info.addrs:
            items = [(p.name, value) for p, value in address.items()]
            if any(name == "p2p-circuit" for name, _ in items):
                continue
            if items and items[0][0] in ("ip4", "ip6"):
                return items[0][0], str(items[0][1])
    return None


# --- the answering side ---------------------------------------------------------------------------------


class DialBackService:
    """The answering side, in the DHT's loop (see the module's doc for its bounds). ``access``: a private
    swarm's access control (None: a public swarm)."""

    def __init__(self, p2p: Any, access: Any = None) -> None:
        self.p2p, self.access = p2p, access
        self.last: dict[bytes, float] = {}  # asker -> when its last answered request came
        self.started: list[float] = []  # when the dials of the last minute started
        self.dialing: set[tuple[str, str]] = set()  # the asker hosts being dialed
        self.seen = possession.SeenNonces() if access is not None else None

    async def answer(self, request: Any, context: Any) -> Any:
        m = messages()
        asker, now = context.remote_id, time.monotonic()
        refusal = self._refusal(request, context)
        if refusal:
            return m.DialBackReply(reached=False, detail=refusal)
        host = asker_host(await self.p2p.list_peers(), asker)
        if host is None:  # relayed (or gone): it cannot be dialed directly
            return m.DialBackReply(reached=False, detail=NOT_REACHED)
        self.started = [t for t in self.started if now - t < 60.0]
        if len(self.dialing) >= MAX_DIALS or len(self.started) >= DIALS_PER_MINUTE or host in self.dialing:
            return m.DialBackReply(reached=False, detail=BUSY)
        if now - self.last.get(asker.to_bytes(), -1e9) < REQUEST_EVERY:  # no answer: the asker tries another
            raise PermissionError("asked again too soon")
        try:
            ports = checked_ports(request.addresses)
        except Exception as e:
            return m.DialBackReply(reached=False, detail=f"refused: {e}"[:MAX_DETAIL])
        self.last = {k: t for k, t in self.last.items() if now - t < REQUEST_EVERY}  # bounded by the rate
        self.last[asker.to_bytes()] = now
        self.started.append(now)
        self.dialing.add(host)
        try:
            reached = await dial(asker, [f"/{host[0]}/{host[1]}/tcp/{port}" for port in ports])
        finally:
            self.dialing.discard(host)
        return m.DialBackReply(reached=reached, detail="" if reached else NOT_REACHED)

    def _refusal(self, request: Any, context: Any) -> str:
        """Why a private swarm refuses the request ("" where it is served)."""
        if self.access is None:
            return ""
        proof = possession.Proof(request.token, request.time, request.nonce, request.signature)
        reason = possession.refusal(
            self.access, PURPOSE, proof, context.remote_id.to_bytes(), context.local_id.to_bytes(), self.seen
        )
        return "" if reason is None else f"refused: {reason}"[:MAX_DETAIL]


async def dial(peer: Any, addresses: list[str], timeout: float = DIAL_TIMEOUT) -> bool:
    """Whether ``peer`` could be dialed at ``addresses`` from a new, dial-only libp2p host (a new connection,
    whatever connections this process has)."""

    probe = await P2P.create(
        host_maddrs=[],
        no_listen=True,
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        startup_timeout=timeout * 2,
    )
    try:
        await asyncio.wait_for(p2p_client(probe).connect(peer, [Multiaddr(a) for a in addresses]), timeout)
        return True
    except Exception as e:
        logger.debug(f"Dial-back to {peer} at {addresses} failed: {e!r}")
        return False
    finally:
        await probe.shutdown()


async def _serve(dht: Any, node: Any) -> None:
    if getattr(dht, "dial_back_service", None) is None and not node.protocol.client_mode:
        authorizer = getattr(node.protocol, "authorizer", None)
        dht.dial_back_service = DialBackService(node.p2p, getattr(authorizer, "access", None))
        await node.p2p.add_protobuf_handler(
            DIAL_BACK_HANDLE, dht.dial_back_service.answer, messages().DialBackRequest
        )


def serve_dial_back(dht: Any) -> None:
    """Answer other peers' dial-back requests (a full peer; a client can be dialed by nobody)."""
    dht.run_coroutine(_serve)


# --- the asking side ------------------------------------------------------------------------------------


def dial_back(
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    timeout: float = ASK_TIMEOUT,
    access: Any = None,
) -> Reachability:
    """Ask the initial peers, in order, to dial this peer back at the addresses it will announce (from a
    short-lived host listening where the peer will listen); the first answer counts, a busy one is asked
    again until ``timeout``. ``access``: a private swarm's access control (its token goes along)."""
    # a thread of its own: the caller may run an event loop already (a notebook's kernel)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dial-back") as pool:
        probe = _dial_back(initial_peers, host_maddrs, announce_maddrs, timeout, access)
        return pool.submit(asyncio.run, probe).result()


async def _dial_back(
    initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str], timeout: float, access: Any
) -> Reachability:

    host = await P2P.create(
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs or None,
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        startup_timeout=timeout,
    )
    try:
        own = [str(a).split("/p2p/")[0] for a in await host.get_visible_maddrs()]
        addresses = unreachable_addresses(own)[:MAX_ADDRESSES]  # fault injection (tests): a closed port
        connected = busy = False
        deadline = time.monotonic() + timeout
        for maddr in initial_peers:
            if "/p2p/" not in maddr:
                continue
            peer = maddr.split("/p2p/")[-1].split("/")[0]
            try:
                peer_id = PeerID.from_base58(peer)
                await asyncio.wait_for(
                    p2p_client(host).connect(peer_id, [Multiaddr(maddr.split("/p2p/")[0])]), DIAL_TIMEOUT
                )
                connected = True
                while True:
                    request = _request(addresses, host.peer_id, peer_id, access)
                    left = max(0.1, deadline - time.monotonic())
                    reply = await asyncio.wait_for(
                        host.call_protobuf_handler(
                            peer_id, DIAL_BACK_HANDLE, request, messages().DialBackReply
                        ),
                        left,
                    )
                    if reply.detail != BUSY:
                        break
                    busy = True
                    if time.monotonic() + BUSY_RETRY >= deadline:
                        raise TimeoutError("busy until the time limit")
                    await asyncio.sleep(BUSY_RETRY)
            except Exception as e:  # unreachable, busy, or a version without the handler: the next one
                logger.debug(f"initial peer {peer} did not answer the dial-back request: {e!r}")
                continue
            detail = " ".join(reply.detail[:MAX_DETAIL].split())  # one line of another peer's text
            return Reachability(bool(reply.reached), peer, tuple(addresses), detail, connected=True)
        return Reachability(None, addresses=tuple(addresses), connected=connected, busy=busy)
    finally:
        await host.shutdown()


def _request(addresses: list[str], asker: Any, answerer: Any, access: Any) -> Any:
    """A dial-back request; in a private swarm with this peer's token and its proof of holding the key."""
    request = messages().DialBackRequest(addresses="\n".join(addresses))
    if access is not None:
        proof = possession.prove(access, PURPOSE, asker.to_bytes(), answerer.to_bytes())
        request.token, request.time, request.nonce = proof.token, proof.time, proof.nonce
        request.signature = proof.signature
    return request
