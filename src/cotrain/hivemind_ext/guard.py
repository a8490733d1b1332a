"""Averaging and state download in a private swarm: only peers that proved a valid access token take part.

hivemind sends averaging, matchmaking and state-download requests over the same libp2p daemon, whose
connections authenticate each peer id. ``GuardedP2P`` (the P2P that averager processes of a private swarm
get from ``SwarmDHT.replicate_p2p``) binds a peer id to a token with a signed handshake per namespace (the
averager's prefix) and refuses every averaging, matchmaking and download request from a peer id that has
not presented a valid token; before calling another peer it makes that handshake itself and checks the
other side's token, so a peer without one can neither join a group, lead one, nor serve or download state.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterable

from hivemind.p2p import P2P, PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from cotrain.access.control import AccessControl
from cotrain.access.tokens import MALFORMED, fingerprints
from cotrain.access.wire import HANDSHAKE, messages
from cotrain.hivemind_ext.authorizer import local_revocations

logger = logging.getLogger(__name__)

MAX_CLOCK_SKEW = 60.0  # seconds between a request's time and the receiver's clock
LOCAL_REFRESH = 2.0  # seconds between an averager process's copies of its own DHT process's list
CLIENT_PROOF_TTL = 20.0  # seconds a peer trusts a handshake it made before making a new one
SERVER_PROOF_TTL = 40.0  # seconds a peer admits another's requests after its handshake


def _namespace_of(handle_name: str) -> str | None:
    return handle_name.split("::", 1)[0] if "::" in handle_name else None


def handshake_payload(kind: bytes, namespace: str, client: PeerID, server: PeerID, t: float, nonce: bytes):
    return b"\n".join(
        [
            b"cotrain-access-handshake/1",
            kind,
            namespace.encode(),
            client.to_bytes(),
            server.to_bytes(),
            repr(float(t)).encode(),
            nonce,
        ]
    )


class GuardedP2P(P2P):
    """hivemind's P2P (a replica in an averager process) that admits averaging, matchmaking and download
    requests only from peers that proved a valid token, and proves its own before calling others."""

    access: AccessControl
    dht: object

    @classmethod
    async def replicate_guarded(cls, daemon_listen_maddr, access: AccessControl, dht) -> GuardedP2P:
        self = await cls.replicate(daemon_listen_maddr)
        return self.setup_guard(access, dht)

    def setup_guard(self, access: AccessControl, dht=None) -> GuardedP2P:
        """``dht`` (to read the revocation list from) may be None for a short-lived client."""
        self.access, self.dht = access, dht
        # what the handshake admitted, and the namespaces whose handshake is served, are shared by the
        # guarded P2Ps of one DHT: two averagers of one prefix in one peer (the monitor's keeper and reducer)
        # answer behind one handshake, which the daemon registers once
        shared = getattr(dht, "cotrain_guard", None) if dht is not None else None
        if shared is None:
            shared = ({}, set())
            if dht is not None:
                dht.cotrain_guard = shared
        self._admitted: dict[tuple[str, PeerID], tuple[float, frozenset[str]]] = shared[0]
        self._trusted: dict[tuple[str, PeerID], float] = {}
        self._pending: dict[tuple[str, PeerID], asyncio.Future] = {}
        self._nonces = TimedStorage()
        self._namespaces: set[str] = shared[1]
        self._revocations_read = 0.0
        self._refreshing: asyncio.Task | None = None
        self._logged: dict[tuple[PeerID, str], float] = {}
        return self

    # server side

    async def add_protobuf_handler(
        self, name, handler, input_protobuf_type, *, stream_input=False, stream_output=False, balanced=False
    ) -> None:
        namespace = _namespace_of(name)
        if namespace is None:
            return await super().add_protobuf_handler(
                name,
                handler,
                input_protobuf_type,
                stream_input=stream_input,
                stream_output=stream_output,
                balanced=balanced,
            )
        if namespace not in self._namespaces:
            self._namespaces.add(namespace)
            await super().add_protobuf_handler(
                f"{namespace}::{HANDSHAKE}",
                functools.partial(self._handshake, namespace),
                messages().AccessRequest,
            )
        await super().add_protobuf_handler(
            name,
            self._guard(namespace, handler, stream_output),
            input_protobuf_type,
            stream_input=stream_input,
            stream_output=stream_output,
            balanced=balanced,
        )

    def _guard(self, namespace: str, handler, stream_output: bool):
        if stream_output:

            async def guarded_stream(request, context):
                self._admit_or_raise(namespace, context.remote_id)
                output = handler(request, context)
                if isinstance(output, AsyncIterable):
                    async for item in output:
                        yield item
                else:
                    yield await output

            return guarded_stream

        async def guarded(request, context):
            self._admit_or_raise(namespace, context.remote_id)
            return await handler(request, context)

        return guarded

    def _admit_or_raise(self, namespace: str, peer: PeerID) -> None:
        self._refresh_revocations_soon()
        entry = self._admitted.get((namespace, peer))
        reason = None
        if entry is None:
            reason = "it has not proven an access token"
        elif entry[0] < time.monotonic():
            reason = "its proof of access is out of date"
        elif entry[1] & self.access.revoked:
            reason = "its access token was revoked"
        if reason is not None:
            self._admitted.pop((namespace, peer), None)
            self._log(peer, f"Refused a request from {peer} to {namespace}: {reason}")
            raise PermissionError(f"access refused: {reason}")

    async def _handshake(self, namespace: str, request, context):
        m = messages()
        self._refresh_revocations_soon()
        reason, token = self._check_handshake(namespace, request, context)
        if reason is not None:
            self._log(context.remote_id, f"Refused peer {context.remote_id} in {namespace}: {reason}")
            return m.AccessReply(granted=False, reason=reason)
        ttl = min(SERVER_PROOF_TTL, float(token.expiration_time) - time.time())
        self._admitted[(namespace, context.remote_id)] = (time.monotonic() + ttl, fingerprints(token))
        own = self.access.own()
        payload = handshake_payload(
            b"reply", namespace, context.remote_id, context.local_id, request.time, request.nonce
        )
        return m.AccessReply(
            granted=True,
            token=own.proto.SerializeToString(),
            nonce=request.nonce,
            signature=own.key.sign(payload),
        )

    def _check_handshake(self, namespace: str, request, context) -> tuple[str | None, AccessToken | None]:
        try:
            token = AccessToken.FromString(request.token) if request.token else None
        except Exception:
            return MALFORMED, None
        reason = self.access.refusal(token)
        if reason is not None:
            return reason, None
        now = get_dht_time()
        if abs(request.time - now) > MAX_CLOCK_SKEW:
            return (
                f"its request is over {MAX_CLOCK_SKEW:.0f} s old or ahead (replayed, or a wrong clock)",
                None,
            )
        if len(request.nonce) < 8 or request.nonce in self._nonces:
            return "its request was replayed", None
        payload = handshake_payload(
            b"request", namespace, context.remote_id, context.local_id, request.time, request.nonce
        )
        if not RSAPublicKey.from_bytes(token.public_key).verify(payload, request.signature):
            return "its request is not signed by the key of the token it shows", None
        self._nonces.store(request.nonce, None, now + 3 * MAX_CLOCK_SKEW)
        return None, token

    def _refresh_revocations_soon(self) -> None:
        if self.access.authority is not None or self._refreshing is not None or self.dht is None:
            return
        if time.monotonic() - self._revocations_read < LOCAL_REFRESH:
            return
        self._revocations_read = time.monotonic()

        async def refresh():
            try:  # the peer's DHT process keeps the list fresh: copy it (no network request, no signature)
                revoked, version = await self.dht.run_coroutine(local_revocations, return_future=True)
                self.access.merge_revocations(revoked, version)
            except Exception as e:
                logger.debug(f"Reading the revocation list failed: {e!r}")
            finally:
                self._refreshing = None

        self._refreshing = asyncio.create_task(refresh())

    def _log(self, peer: PeerID, message: str) -> None:
        key = (peer, message.rsplit(":", 1)[-1])
        if time.monotonic() - self._logged.get(key, -1e9) > 60:
            self._logged[key] = time.monotonic()
            logger.info(message)

    # client side

    async def call_protobuf_handler(self, peer_id, name, input, output_protobuf_type):
        await self._prove_access(peer_id, name)
        return await super().call_protobuf_handler(peer_id, name, input, output_protobuf_type)

    async def iterate_protobuf_handler(self, peer_id, name, input, output_protobuf_type):
        await self._prove_access(peer_id, name)
        return await super().iterate_protobuf_handler(peer_id, name, input, output_protobuf_type)

    async def _prove_access(self, peer: PeerID, handle_name: str) -> None:
        namespace = _namespace_of(handle_name)
        if namespace is None or handle_name.endswith(HANDSHAKE):
            return
        key = (namespace, peer)
        if self._trusted.get(key, 0.0) > time.monotonic():
            return
        future = self._pending.get(key)
        if future is None:
            future = self._pending[key] = asyncio.ensure_future(self._handshake_with(peer, namespace))
            future.add_done_callback(lambda _: self._pending.pop(key, None))
        await asyncio.shield(future)

    async def _handshake_with(self, peer: PeerID, namespace: str) -> None:
        m = messages()
        own = self.access.own()
        request = m.AccessRequest(
            token=own.proto.SerializeToString(), time=get_dht_time(), nonce=secrets.token_bytes(16)
        )
        payload = handshake_payload(b"request", namespace, self.peer_id, peer, request.time, request.nonce)
        request.signature = own.key.sign(payload)
        reply = await asyncio.wait_for(
            P2P.call_protobuf_handler(self, peer, f"{namespace}::{HANDSHAKE}", request, m.AccessReply), 30
        )
        if not reply.granted:
            raise PermissionError(f"peer {peer} refused this peer's access token: {reply.reason}")
        try:
            token = AccessToken.FromString(reply.token)
        except Exception:
            token = None
        reason = self.access.refusal(token)
        if reason is not None:
            raise PermissionError(f"peer {peer} has no valid access token ({reason})")
        payload = handshake_payload(b"reply", namespace, self.peer_id, peer, request.time, request.nonce)
        if reply.nonce != request.nonce or not RSAPublicKey.from_bytes(token.public_key).verify(
            payload, reply.signature
        ):
            raise PermissionError(
                f"peer {peer} answered with a proof of access that does not match its token"
            )
        ttl = min(CLIENT_PROOF_TTL, float(token.expiration_time) - time.time())
        self._trusted[(namespace, peer)] = time.monotonic() + ttl
