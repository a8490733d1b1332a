"""DHT requests of a private swarm, in the peer's DHT process: hivemind's token protocol with cotrain's
tokens, the access check other peers ask, and the revocation list kept fresh (published by the monitor).

Each DHT request carries the sender's token, a timestamp, a random nonce and a signature by the token's key;
the receiver checks the token against the authority key, the revocation list and the expiry, the signature,
the time (within a minute) and that the nonce is new (replays are refused). Responses are signed the same way,
so a peer without a token cannot serve DHT answers either.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from cotrain.access.authority import count_tokens
from cotrain.access.control import AccessControl
from cotrain.access.tokens import MALFORMED, REVOKED
from cotrain.access.wire import CHECK_HANDLE, messages
from cotrain.hivemind_ext.hooks import Authorizer

logger = logging.getLogger(__name__)

REVOCATIONS_REFRESH = 5.0  # seconds between a peer's reads of the revocation list from the DHT
REVOCATIONS_TTL = 3600.0  # seconds a published revocation list lives in the DHT (the monitor republishes it)
REPUBLISH = 30.0  # seconds between the monitor's publications when nothing changed


class SwarmAuthorizer(Authorizer):
    """hivemind's token protocol for DHT requests and responses, with cotrain's tokens."""

    def __init__(self, access: AccessControl) -> None:
        super().__init__(local_private_key=access.own().key)
        self.access = access
        self._logged: dict[str, float] = {}

    async def get_token(self) -> AccessToken:
        own = self.access.own()
        self.set_local_key(own.key)
        return own.proto

    def is_token_valid(self, access_token: AccessToken) -> bool:
        reason = self.access.refusal(access_token)
        if reason is not None:
            self._log_refusal(reason)
        return reason is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return access_token is not self.access.own().proto

    def _log_refusal(self, reason: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(reason, -1e9) > 60:
            self._logged[reason] = now
            logger.info(f"Refused a DHT request: {reason}")


async def start_access_service(dht, node) -> None:
    """Runs in the DHT process: answer access checks (a full peer), keep the revocation list fresh (every
    peer) and, at the monitor, publish it."""
    access: AccessControl = node.protocol.authorizer.access
    if not node.protocol.client_mode:
        await node.p2p.add_protobuf_handler(
            CHECK_HANDLE, functools.partial(_answer_check, access), messages().AccessRequest
        )
    asyncio.create_task(_revocations_loop(node, access))


async def _answer_check(access: AccessControl, request, context):
    """Whether the asker's token grants access here; a refusal for revocation carries the signed revocation
    list as its proof (the asker stops only on a refusal it can verify, see cotrain.net.probe)."""
    m = messages()
    token = None
    if request.token:
        try:
            token = AccessToken.FromString(request.token)
        except Exception:
            return m.AccessReply(granted=False, reason=MALFORMED)
    reason = access.refusal(token)
    reply = m.AccessReply(granted=reason is None, reason=reason or "")
    if reason is not None and REVOKED in reason and access.revocations_record is not None:
        reply.revocations = MSGPackSerializer.dumps(access.revocations_record)
    return reply


async def _revocations_loop(node, access: AccessControl) -> None:
    published, published_at = None, 0.0
    while True:
        try:
            if access.authority is not None:
                revoked = access.revoked
                if revoked != published or time.monotonic() - published_at > REPUBLISH:
                    value = access.authority.signed_revocations(get_dht_time() + REVOCATIONS_TTL)
                    access.revocations_record = value  # the proof that check answers carry
                    await node.store(access.revocations_key, value, expiration_time=value["expires"])
                    if revoked != published:
                        # tokens, as `cotrain token revoke` counts them, not their names (each has two)
                        listed = count_tokens(len(access.authority.revoked_tokens()), "revoked")
                        logger.info(f"Published the revocation list: {listed}")
                    published, published_at = revoked, time.monotonic()
            else:
                found = await node.get(access.revocations_key, latest=True)
                if found is not None:
                    access.accept_revocations(found.value)
        except Exception as e:
            logger.debug(f"Revocation list refresh failed: {e!r}")
        await asyncio.sleep(REVOCATIONS_REFRESH)


async def local_revocations(dht, node) -> tuple[list[str], float]:
    """Runs in the DHT process: the revocation list it holds (checked when it was read from the DHT)."""
    access: AccessControl = node.protocol.authorizer.access
    return sorted(access.revoked), access.revocations_version
