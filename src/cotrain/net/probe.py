"""A refused peer finds out why: the access check it asks the initial peers (after its DHT could not join),
and the watcher that ends a running role with one line once the swarm stops accepting its token.

The answers come over libp2p connections that authenticate the initial peers' ids (the ones the user gave),
but any participant can be an initial peer, and the answer itself is not signed: a refusal stops this peer
only when it can check it (``judge``). Any other refusal is logged as unverified and changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer

from cotrain.access.authority import verify_revocations
from cotrain.access.control import AccessControl
from cotrain.access.tokens import FOREIGN, NO_TOKEN, REVOKED, fingerprints, iso
from cotrain.access.wire import CHECK_HANDLE, messages
from cotrain.hivemind_ext.hooks import p2p_client
from cotrain.hivemind_ext.unexported import Multiaddr

logger = logging.getLogger(__name__)

MAX_PROOF = 4 * 1024 * 1024  # bytes of a revocation list carried by a refusal
MAX_REASON = 300  # characters of a refusal's reason shown or logged

PUBLIC_SWARM = (
    "this peer has an access token, but the swarm at its initial peers does not check tokens (a public "
    "swarm, or another version): leave out --access-token"
)


def refused_message(reason: str) -> str:
    return reason if reason in (NO_TOKEN, PUBLIC_SWARM) else f"the swarm refused this peer: {reason}"


def peer_ids(maddrs: list[str]) -> list[str]:
    return [m.split("/p2p/")[-1].split("/")[0] for m in maddrs if "/p2p/" in m]


@dataclass(frozen=True)
class Verdict:
    """What this peer makes of an initial peer's answer to its access check."""

    stop: str | None = None  # a refusal this peer verified: it stops with this line
    unverified: str | None = None  # a refusal it could not verify: logged, not acted on


def _clean(reason: str) -> str:
    """Another peer's text, safe to log: one line of printable characters, capped."""
    return "".join(c if c.isprintable() else "?" for c in reason[:MAX_REASON])


def _signed_revoked(proof: bytes, access: AccessControl) -> frozenset[str] | None:
    """The fingerprints in ``proof`` if it is a revocation list the swarm's authority signed, else None."""
    if not proof or len(proof) > MAX_PROOF:
        return None
    try:
        value = MSGPackSerializer.loads(proof)
    except Exception:
        return None
    if not verify_revocations(value, access.authority_key):
        return None
    access.accept_revocations(value)  # this peer's own checks agree from now on (when the list is newer)
    return frozenset(value["revoked"])


def judge(reply, access: AccessControl | None, joined: bool) -> Verdict:
    """Whether an initial peer's answer (``reply``: an AccessReply) to this peer's access check may stop
    this peer. A refusal stops it only when the peer can check it:

    - the peer has no token (``access`` None): a private swarm refuses it;
    - its own check of its token refuses it too (expired on its clock, or revoked in a list it verified);
    - the answer says revoked and carries a revocation list, signed by the authority that signed this
      peer's token, naming this token;
    - the peer has not joined yet (``joined`` False) and the answer says its token is not the swarm
      authority's: nothing the peer knows contradicts it (its token names no swarm). Once the peer has
      joined, the swarm accepted its token, so that claim is false.

    Anything else (revoked without a signed list, expired while this peer's clock says otherwise, malformed)
    is unverified."""
    if reply.granted:
        return Verdict()
    reason = _clean(reply.reason)
    if access is None:
        return Verdict(stop=NO_TOKEN)
    own = access.own_refusal()
    if own is not None:
        return Verdict(stop=own)
    token = access.own().proto
    if REVOKED in reason:
        listed = _signed_revoked(reply.revocations, access)
        if listed is not None and fingerprints(token) & listed:
            return Verdict(stop=f"access token {token.username!r} {REVOKED}")
        return Verdict(unverified=f"{reason} (without a revocation list signed by the authority naming it)")
    if FOREIGN in reason and not joined:
        return Verdict(stop=f"access token {token.username!r} {FOREIGN} (or was altered)")
    return Verdict(unverified=reason)


async def _ask(p2p: P2P, peer: str, token: bytes, timeout: float):
    m = messages()
    return await asyncio.wait_for(
        p2p.call_protobuf_handler(
            PeerID.from_base58(peer), CHECK_HANDLE, m.AccessRequest(token=token), m.AccessReply
        ),
        timeout,
    )


async def _own_access(dht, node, peers: list[str]) -> Verdict:
    """Runs in the DHT process of a running peer: whether its token is refused (its own view, then the
    initial peers', see ``judge``)."""
    access: AccessControl = node.protocol.authorizer.access
    reason = access.own_refusal()
    if reason is not None:
        return Verdict(stop=reason)
    token = access.own().proto.SerializeToString()
    unverified = Verdict()
    for peer in peers:
        try:
            reply = await _ask(node.p2p, peer, token, 10.0)
        except Exception:
            continue
        verdict = judge(reply, access, joined=True)
        if verdict.unverified is None:
            return verdict
        unverified = Verdict(unverified=f"initial peer {peer}: {verdict.unverified}")
    return unverified


def probe_refusal(initial_peers: list[str], access: AccessControl | None, timeout: float = 5.0) -> str | None:
    """After the DHT could not join: ask the initial peers, from a short-lived P2P of this process, whether
    they refused this peer's token, and why. None when no peer answered (unreachable, or a public swarm) or
    no refusal could be verified (see ``judge``; those are logged)."""
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
                    dial = p2p_client(p2p).connect(PeerID.from_base58(peer), [address])
                    await asyncio.wait_for(dial, timeout)
                except Exception:
                    continue
                try:
                    reply = await _ask(p2p, peer, token, timeout)
                except Exception:
                    if access is not None:
                        return PUBLIC_SWARM
                    continue
                verdict = judge(reply, access, joined=False)
                if verdict.unverified is None:
                    return verdict.stop
                logger.warning(
                    f"Initial peer {peer} refused this peer's access token, but this peer cannot verify its "
                    f"answer (so it is not taken as the reason): {verdict.unverified}"
                )
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
    token will expire within the hour (a renewed token file is picked up without a restart).

    It logs the refusal as an error too, unless ``logs_refusal`` is False: a role's worker process
    (cotrain._worker) sets that, as it prints the refusal itself as the role's one error line."""

    logs_refusal: ClassVar[bool] = True

    def __init__(self, dht, initial_peers: list[str], stop: threading.Event, period: float = 3.0) -> None:
        super().__init__(daemon=True, name="access-watcher")
        self.dht, self.peers, self.stop, self.period = dht, peer_ids(initial_peers), stop, period
        self.refusal: str | None = None
        self._warned = False
        self._told: dict[str, float] = {}

    def run(self) -> None:
        access: AccessControl = self.dht.access
        while not self.stop.wait(self.period):
            try:
                verdict = self.dht.run_coroutine(
                    functools.partial(_own_access, peers=self.peers), return_future=True
                ).result(timeout=30)
            except Exception as e:
                logger.debug(f"access check failed: {e!r}")
                continue
            if verdict.stop is not None:
                self.refusal = f"the swarm refused this peer: {verdict.stop}"
                if self.logs_refusal:
                    logger.error(self.refusal)
                self.stop.set()
                return
            if (
                verdict.unverified is not None
                and time.monotonic() - self._told.get(verdict.unverified, -1e9) > 60
            ):
                self._told[verdict.unverified] = time.monotonic()
                logger.warning(
                    f"An unverified refusal of this peer's access token, not acted on: {verdict.unverified}"
                )
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
