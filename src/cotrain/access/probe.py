"""A refused peer finds out why: the access check it asks the initial peers (after its DHT could not join),
and the watcher that ends a running role with one line once the swarm stops accepting its token."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

from hivemind.p2p import P2P, PeerID

from cotrain.access.control import AccessControl
from cotrain.access.tokens import NO_TOKEN, iso
from cotrain.access.wire import CHECK_HANDLE, messages

logger = logging.getLogger(__name__)

PUBLIC_SWARM = (
    "this peer has an access token, but the swarm at its initial peers does not check tokens (a public "
    "swarm, or another version): leave out --access-token"
)


def refused_message(reason: str) -> str:
    return reason if reason in (NO_TOKEN, PUBLIC_SWARM) else f"the swarm refused this peer: {reason}"


def peer_ids(maddrs: list[str]) -> list[str]:
    return [m.split("/p2p/")[-1].split("/")[0] for m in maddrs if "/p2p/" in m]


async def _ask(p2p: P2P, peer: str, token: bytes, timeout: float):
    m = messages()
    return await asyncio.wait_for(
        p2p.call_protobuf_handler(
            PeerID.from_base58(peer), CHECK_HANDLE, m.AccessRequest(token=token), m.AccessReply
        ),
        timeout,
    )


async def _own_access(dht, node, peers: list[str]) -> str | None:
    """Runs in the DHT process: why this peer's token is refused (its own view, then the initial peers')."""
    access: AccessControl = node.protocol.authorizer.access
    reason = access.own_refusal()
    if reason is not None:
        return reason
    token = access.own().proto.SerializeToString()
    for peer in peers:
        try:
            reply = await _ask(node.p2p, peer, token, 10.0)
        except Exception:
            continue
        return None if reply.granted else reply.reason
    return None


def probe_refusal(initial_peers: list[str], access: AccessControl | None, timeout: float = 5.0) -> str | None:
    """After the DHT could not join: ask the initial peers, from a short-lived P2P of this process, whether
    they refused this peer's token, and why. None when no peer answered (unreachable, or a public swarm)."""
    from hivemind.utils.multiaddr import Multiaddr

    token = access.own().proto.SerializeToString() if access is not None else b""

    async def probe() -> str | None:
        p2p = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            nat_port_map=False,
            auto_nat=False,
            use_relay=False,
            startup_timeout=timeout * 2,
        )
        try:
            for maddr in initial_peers:
                if "/p2p/" not in maddr:
                    continue
                peer = peer_ids([maddr])[0]
                try:
                    address = Multiaddr(maddr.split("/p2p/")[0])
                    await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), [address]), timeout)
                except Exception:
                    continue
                try:
                    reply = await _ask(p2p, peer, token, timeout)
                except Exception:
                    if access is not None:
                        return PUBLIC_SWARM
                    continue
                return None if reply.granted else reply.reason
            return None
        finally:
            await p2p.shutdown()

    try:
        return asyncio.run(asyncio.wait_for(probe(), timeout * 4))
    except Exception as e:
        logger.debug(f"access probe failed: {e!r}")
        return None


class AccessWatcher(threading.Thread):
    """Checks every few seconds that this peer's token is still accepted (not expired, not revoked). When it
    is refused, it records why and sets ``stop``: the role ends with that one line. It warns once when the
    token will expire within the hour (a renewed token file is picked up without a restart)."""

    def __init__(self, dht, initial_peers: list[str], stop: threading.Event, period: float = 3.0) -> None:
        super().__init__(daemon=True, name="access-watcher")
        self.dht, self.peers, self.stop, self.period = dht, peer_ids(initial_peers), stop, period
        self.refusal: str | None = None
        self._warned = False

    def run(self) -> None:
        access: AccessControl = self.dht.access
        while not self.stop.wait(self.period):
            try:
                reason = self.dht.run_coroutine(
                    functools.partial(_own_access, peers=self.peers), return_future=True
                ).result(timeout=30)
            except Exception as e:
                logger.debug(f"access check failed: {e!r}")
                continue
            if reason is not None:
                self.refusal = f"the swarm refused this peer: {reason}"
                logger.error(self.refusal)
                self.stop.set()
                return
            own = access.own()
            left = own.expiration - time.time()
            if left < 3600 and not self._warned:
                self._warned = True
                logger.warning(
                    f"Access token {own.name!r} expires at {iso(own.expiration)}: ask for a renewed token "
                    f"and replace {access.token_path} with it (no restart needed)"
                )
            elif left >= 3600:
                self._warned = False
