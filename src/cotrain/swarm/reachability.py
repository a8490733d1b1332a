"""Reachability, measured: can other peers dial this one? A peer asks an initial peer to dial it back.

A peer behind NAT that announces itself as a full peer breaks others' rounds (they are given parts it cannot
be sent), and one that cannot be dialed cannot reduce anything. So a trainer started without
``--client-mode`` finds out before it joins (``dial_back``): it starts a short-lived libp2p host on the
addresses it will listen on and announce, connects to an initial peer, and asks it to dial those addresses
back (``DIAL_BACK_HANDLE``). The initial peer answers from a host of its own, made for the one dial (a new
identity, dial-only, no relay): a new connection to the announced addresses, never the one the asking peer
opened. Reached: the peer joins as a full peer. Not reached: it joins as a client and says why. No answer
within the time limit (an older version, a busy initial peer): it assumes it is public, as before, and says
so. Petals checks its servers' reachability the same way.

The request is hostile until checked: at most ``MAX_ADDRESSES`` addresses of ``MAX_ADDRESS_CHARS``
characters, each a parsable multiaddr of an IP or DNS address and a TCP or UDP port; one dial at a time per
answering peer, and one request per asking peer every ``REQUEST_EVERY`` seconds. The dial must reach the
asking peer's own id (libp2p authenticates it), so it cannot be pointed at another peer's address to any
effect.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Any

from cotrain.faults import unreachable_addresses
from cotrain.swarm.internals.hooks import p2p_client

logger = logging.getLogger(__name__)

DIAL_BACK_HANDLE = "cotrain.DialBack"  # answered by every full peer
DIAL_TIMEOUT = 5.0  # seconds the answering peer's dial may take
ASK_TIMEOUT = DIAL_TIMEOUT + 10.0  # seconds an asked peer has to answer (its dial host starts first)
MAX_ADDRESSES = 8
MAX_ADDRESS_CHARS = 200
REQUEST_EVERY = 10.0  # seconds between two requests of one asking peer that are answered
MAX_DETAIL = 200  # characters of the reason a dial failed, as answered


@functools.cache
def messages():
    """The dial-back request and answer, built at first use from a descriptor."""
    from cotrain.access.wire import build_messages

    return build_messages(
        "cotrain_dialback.proto",
        {
            "DialBackRequest": [("addresses", "string")],  # newline-separated multiaddrs, without /p2p
            "DialBackReply": [("reached", "bool"), ("detail", "string")],
        },
    )


@dataclasses.dataclass(frozen=True)
class Reachability:
    """What the dial-back probe found: ``reached`` True (others can dial this peer), False (they cannot), None
    (nobody answered); ``peer``: the initial peer that answered; ``addresses``: those it was asked to dial;
    ``detail``: why its dial failed; ``connected``: whether an initial peer could be connected to at all."""

    reached: bool | None
    peer: str = ""
    addresses: tuple[str, ...] = ()
    detail: str = ""
    connected: bool = False  # whether any initial peer could be connected to (None: it did not answer)


def checked_addresses(text: str) -> list[Any]:
    """The multiaddrs of a dial-back request that may be dialed (see the module's doc), or ValueError."""
    from hivemind.utils.multiaddr import Multiaddr

    lines = [line for line in text.split("\n") if line]
    if not lines or len(lines) > MAX_ADDRESSES:
        raise ValueError(f"between 1 and {MAX_ADDRESSES} addresses, got {len(lines)}")
    out = []
    for line in lines:
        if len(line) > MAX_ADDRESS_CHARS:
            raise ValueError("an address longer than the limit")
        address = Multiaddr(line)
        names = [p.name for p in address.protocols()]
        if (
            names[0] not in ("ip4", "ip6", "dns", "dns4", "dns6")
            or len(names) < 2
            or names[1] not in ("tcp", "udp")
        ):
            raise ValueError(f"not an IP or DNS address with a TCP or UDP port: {line}")
        if "p2p" in names or "p2p-circuit" in names:
            raise ValueError(f"a relayed or peer-qualified address: {line}")
        out.append(address)
    return out


# --- the answering side ---------------------------------------------------------------------------------


class DialBackService:
    """The answering side, in the DHT's loop: one dial at a time, one answered request per asking peer every
    REQUEST_EVERY seconds."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.last: dict[bytes, float] = {}

    async def answer(self, request: Any, context: Any) -> Any:
        m = messages()
        asker = context.remote_id
        now = time.monotonic()
        if now - self.last.get(asker.to_bytes(), -1e9) < REQUEST_EVERY:  # no answer: the asker tries another
            raise PermissionError("asked again too soon")
        self.last = {k: t for k, t in self.last.items() if now - t < REQUEST_EVERY}  # bounded by the rate
        self.last[asker.to_bytes()] = now
        try:
            addresses = checked_addresses(request.addresses)
        except Exception as e:
            return m.DialBackReply(reached=False, detail=f"refused: {e}"[:MAX_DETAIL])
        async with self.lock:
            reached, detail = await dial(asker, addresses)
        return m.DialBackReply(reached=reached, detail=detail[:MAX_DETAIL])


async def dial(peer: Any, addresses: list[Any], timeout: float = DIAL_TIMEOUT) -> tuple[bool, str]:
    """Dial ``peer`` at ``addresses`` from a new, dial-only libp2p host (a new connection, whatever
    connections this process has): (reached, why not)."""
    from hivemind.p2p import P2P

    probe = await P2P.create(
        host_maddrs=[],
        no_listen=True,
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        startup_timeout=timeout * 2,
    )
    try:
        await asyncio.wait_for(p2p_client(probe).connect(peer, addresses), timeout)
        return True, ""
    except Exception as e:
        return False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    finally:
        await probe.shutdown()


async def _serve(dht: Any, node: Any) -> None:
    if getattr(dht, "dial_back_service", None) is None and not node.protocol.client_mode:
        dht.dial_back_service = DialBackService()
        await node.p2p.add_protobuf_handler(
            DIAL_BACK_HANDLE, dht.dial_back_service.answer, messages().DialBackRequest
        )


def serve_dial_back(dht: Any) -> None:
    """Answer other peers' dial-back requests (a full peer; a client can be dialed by nobody)."""
    dht.run_coroutine(_serve)


# --- the asking side ------------------------------------------------------------------------------------


def dial_back(
    initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str], timeout: float = ASK_TIMEOUT
) -> Reachability:
    """Ask the initial peers, in order, to dial this peer back at the addresses it will announce (from a
    short-lived host listening where the peer will listen); the first answer counts."""
    # a thread of its own: the caller may run an event loop already (a notebook's kernel)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dial-back") as pool:
        probe = _dial_back(initial_peers, host_maddrs, announce_maddrs, timeout)
        return pool.submit(asyncio.run, probe).result()


async def _dial_back(
    initial_peers: list[str], host_maddrs: list[str], announce_maddrs: list[str], timeout: float
) -> Reachability:
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    m = messages()
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
        request = m.DialBackRequest(addresses="\n".join(addresses))
        connected = False
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
                reply = await asyncio.wait_for(
                    host.call_protobuf_handler(peer_id, DIAL_BACK_HANDLE, request, m.DialBackReply), timeout
                )
            except Exception as e:  # unreachable, busy, or a version without the handler: the next one
                logger.debug(f"initial peer {peer} did not answer the dial-back request: {e!r}")
                continue
            detail = " ".join(reply.detail[:MAX_DETAIL].split())  # one line of another peer's text
            return Reachability(bool(reply.reached), peer, tuple(addresses), detail, connected=True)
        return Reachability(None, addresses=tuple(addresses), connected=connected)
    finally:
        await host.shutdown()
