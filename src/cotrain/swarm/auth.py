"""Private swarms: every DHT, averaging and state-download request carries a valid access token.

Three layers, all keyed to the swarm's authority (see cotrain.tokens for the tokens themselves):

- DHT requests: hivemind's ``TokenAuthorizerBase`` (``SwarmAuthorizer``). Each request carries the sender's
  token, a timestamp, a random nonce and a signature by the token's key; the receiver checks the token
  against the authority key, the revocation list and the expiry, the signature, the time (within a minute) and
  that the nonce is new (replays are refused). Responses are signed the same way, so a peer without a token
  cannot serve DHT answers either.
- Averaging and state download: ``GuardedP2P`` (cotrain.swarm.guard) admits averaging, matchmaking and
  download requests only from peer ids that proved a valid token with a signed handshake, and proves its
  own before calling others.
- Revocation: the monitor holds the authority key, signs the list of revoked tokens and keeps it in the DHT;
  every process re-reads it every few seconds, and a DHT validator refuses lists the authority did not sign.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from cotrain.errors import UserError
from cotrain.tokens import (
    NO_TOKEN,
    Authority,
    PrivateKey,
    TokenFile,
    check_token,
    fingerprint,
    iso,
    read_token_file,
    verify_revocations,
)

logger = logging.getLogger(__name__)

CHECK_HANDLE = "cotrain.AccessCheck"  # answered by every full peer of a private swarm, token or not
HANDSHAKE = "cotrain.AccessHandshake"  # per averager namespace: binds a peer id to a token
MAX_CLOCK_SKEW = 60.0  # seconds between a request's time and the receiver's clock
REVOCATIONS_REFRESH = 5.0  # seconds between a peer's reads of the revocation list from the DHT
LOCAL_REFRESH = 2.0  # seconds between an averager process's copies of its own DHT process's list
REVOCATIONS_TTL = 3600.0  # seconds a published revocation list lives in the DHT (the monitor republishes it)
REPUBLISH = 30.0  # seconds between the monitor's publications when nothing changed
CLIENT_PROOF_TTL = 20.0  # seconds a peer trusts a handshake it made before making a new one
SERVER_PROOF_TTL = 40.0  # seconds a peer admits another's requests after its handshake
OWN_TOKEN_RECHECK = 2.0  # seconds between checks that this peer's token file was replaced (renewed)
AUTHORITY_SELF_TOKEN_DAYS = 1.0


@dataclass
class Credential:
    """This peer's own token and the private key that proves it owns it."""

    name: str
    proto: AccessToken
    key: PrivateKey
    expiration: float


def revocations_key(run_id: str) -> str:
    return f"{run_id}_access_revocations"


class AccessControl:
    """What one peer of a private swarm knows: the authority's public key, its own credential and the revoked
    tokens. A copy lives in each of the peer's processes (the DHT's, the averagers')."""

    def __init__(
        self,
        run_id: str,
        authority_public_key: bytes,
        *,
        token_path: str | None = None,
        authority: Authority | None = None,
    ) -> None:
        self.run_id = run_id
        self.authority_public_key = authority_public_key
        self.token_path = token_path
        self.authority = authority
        self._authority_key = RSAPublicKey.from_bytes(authority_public_key)
        self._revoked: frozenset[str] = frozenset()
        self.revocations_version = -1.0
        self._registry_mtime: float | None = None
        self._own: Credential | None = None
        self._own_mtime = 0.0
        self._own_checked = 0.0
        self._checked: dict[bytes, tuple[bytes, float]] = {}  # signature -> (token bytes, expiry), valid ones
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def for_token(cls, run_id: str, path: str) -> AccessControl:
        token = read_token_file(path)
        access = cls(run_id, token.authority_public_key, token_path=path)
        access._set_own(token, Path(path).stat().st_mtime)
        reason = access.refusal(token.proto())
        if reason is not None:
            raise UserError(f"{reason}: ask the swarm's operator for a new token ({path})")
        return access

    @classmethod
    def for_authority(cls, run_id: str, key_path: str) -> AccessControl:
        authority = Authority.load(key_path)
        authority.entries()  # a damaged registry is reported now, not in the middle of a run
        return cls(run_id, authority.public_key_bytes, authority=authority)

    @property
    def revocations_key(self) -> str:
        return revocations_key(self.run_id)

    @property
    def name(self) -> str:
        return self.own().name

    # --- tokens ---------------------------------------------------------------------------------

    @property
    def revoked(self) -> frozenset[str]:
        if self.authority is not None:  # the monitor reads its registry (`cotrain token revoke` writes it)
            path = self.authority.registry_path
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:
                mtime = 0.0
            if mtime != self._registry_mtime:
                try:
                    self._revoked = frozenset(self.authority.revoked_fingerprints())
                    self._registry_mtime = mtime
                except UserError as e:
                    logger.warning(f"{e}; keeping the previous revocations")
        return self._revoked

    def refusal(self, token: AccessToken | None) -> str | None:
        """Why ``token`` grants no access (one sentence), or None when it does. A token seen before (the
        same signature) skips the signature check; its expiry and revocation are checked every time."""
        signature = token.signature if token is not None else b""
        known = self._checked.get(signature)
        if known is not None and known[0] == token.SerializeToString():
            if fingerprint(signature) in self.revoked:
                return f"access token {token.username!r} was revoked by the swarm's operator"
            if known[1] <= time.time():
                return f"access token {token.username!r} expired at {iso(known[1])}"
            return None
        reason = check_token(token, self._authority_key, self.revoked)
        if reason is None:
            if len(self._checked) > 1024:
                self._checked.clear()
            self._checked[signature] = (token.SerializeToString(), float(token.expiration_time))
        return reason

    def _set_own(self, token: TokenFile, mtime: float) -> None:
        self._own = Credential(token.name, token.proto(), token.private_key, token.expiration)
        self._own_mtime = mtime

    def own(self) -> Credential:
        """This peer's credential: re-read when its token file is replaced (a renewed token needs no
        restart); the monitor signs its own, renewing it a while before it expires."""
        now = time.time()
        with self._lock:
            if self.authority is not None:
                if self._own is None or self._own.expiration - now < 3600:
                    key = self._own.key if self._own is not None else None
                    if key is None:
                        key = PrivateKey()
                    token = self.authority.mint("authority", key, now + AUTHORITY_SELF_TOKEN_DAYS * 86400)
                    self._set_own(token, 0.0)
                return self._own
            if self._own is None or now - self._own_checked >= OWN_TOKEN_RECHECK:
                self._own_checked = now
                self._reload_own()
            return self._own

    def _reload_own(self) -> None:
        try:
            mtime = Path(self.token_path).stat().st_mtime
        except OSError:
            return
        if self._own is not None and mtime == self._own_mtime:
            return
        try:
            token = read_token_file(self.token_path)
        except UserError as e:
            logger.warning(f"Not using the replaced token file: {e}")
            self._own_mtime = mtime
            return
        if token.authority_public_key != self.authority_public_key:
            logger.warning(
                f"Not using the replaced token file {self.token_path}: another authority signed it"
            )
        elif self._own is None or token.proto() != self._own.proto:
            logger.info(f"Using the renewed access token {token.name!r}, valid until {iso(token.expiration)}")
            self._set_own(token, mtime)
            return
        self._own_mtime = mtime

    def own_refusal(self) -> str | None:
        return self.refusal(self.own().proto)

    # --- revocations ----------------------------------------------------------------------------

    def accept_revocations(self, value: object) -> bool:
        """Take a revocation list read from the DHT if the authority signed it and it is newer."""
        if self.authority is not None or not verify_revocations(value, self._authority_key):
            return False
        if value["version"] <= self.revocations_version:
            return False
        newly = set(value["revoked"]) - self._revoked
        self._revoked = frozenset(value["revoked"]) | self._revoked  # a revocation is never taken back
        self.revocations_version = float(value["version"])
        if newly:
            logger.debug(f"{len(newly)} more revoked access token(s)")
        return True

    def merge_revocations(self, revoked: list[str], version: float) -> None:
        """Take the list this peer's own DHT process checked and holds."""
        if self.authority is None and version > self.revocations_version:
            self._revoked = frozenset(revoked) | self._revoked
            self.revocations_version = version

    def validators(self) -> list[RecordValidatorBase]:
        return [RevocationsValidator(self.revocations_key, self.authority_public_key)]

    def authorizer(self) -> SwarmAuthorizer:
        return SwarmAuthorizer(self)


class RevocationsValidator(RecordValidatorBase):
    """Refuses a revocation list in the DHT unless the authority signed it for the record's expiration: an
    allowlisted peer cannot hide revocations by storing another list under the same key."""

    def __init__(self, key: str, authority_public_key: bytes) -> None:
        self._key = DHTID.generate(source=key).to_bytes()
        self._authority_public_key = authority_public_key
        self._authority_key = RSAPublicKey.from_bytes(authority_public_key)

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        return verify_revocations(value, self._authority_key, record.expiration_time)

    def __getstate__(self):
        return {"key": self._key, "authority_public_key": self._authority_public_key}

    def __setstate__(self, state):
        self._key = state["key"]
        self._authority_public_key = state["authority_public_key"]
        self._authority_key = RSAPublicKey.from_bytes(state["authority_public_key"])


# --- DHT requests ---------------------------------------------------------------------------------


class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token protocol for DHT requests and responses, with cotrain's tokens."""

    def __init__(self, access: AccessControl) -> None:
        super().__init__(local_private_key=access.own().key)
        self.access = access
        self._logged: dict[str, float] = {}

    async def get_token(self) -> AccessToken:
        own = self.access.own()
        self._local_private_key, self._local_public_key = own.key, own.key.get_public_key()
        return own.proto

    def is_token_valid(self, access_token: AccessToken) -> bool:
        reason = self.access.refusal(access_token)
        if reason is not None:
            self._log_refusal(reason)
        return reason is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return access_token is not self.access.own().proto

    async def refresh_token_if_needed(self) -> None:
        # hivemind asserts that its own token is valid; an expired or revoked one is reported by the peer's
        # AccessWatcher instead of failing every request of this process with an AssertionError
        if self._local_access_token is None or self.does_token_need_refreshing(self._local_access_token):
            async with self._refresh_lock:
                self._local_access_token = await self.get_token()

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
    m = messages()
    token = None
    if request.token:
        try:
            token = AccessToken.FromString(request.token)
        except Exception:
            return m.AccessReply(granted=False, reason="the access token is malformed")
    reason = access.refusal(token)
    return m.AccessReply(granted=reason is None, reason=reason or "")


async def _revocations_loop(node, access: AccessControl) -> None:
    published, published_at = None, 0.0
    while True:
        try:
            if access.authority is not None:
                revoked = access.revoked
                if revoked != published or time.monotonic() - published_at > REPUBLISH:
                    value = access.authority.signed_revocations(get_dht_time() + REVOCATIONS_TTL)
                    await node.store(access.revocations_key, value, expiration_time=value["expires"])
                    if revoked != published:
                        logger.info(
                            f"Published the revocation list ({len(value['revoked'])} revoked token(s))"
                        )
                    published, published_at = revoked, time.monotonic()
            else:
                found = await node.get(access.revocations_key, latest=True)
                if found is not None:
                    access.accept_revocations(found.value)
        except Exception as e:
            logger.debug(f"Revocation list refresh failed: {e!r}")
        await asyncio.sleep(REVOCATIONS_REFRESH)


async def _local_revocations(dht, node) -> tuple[list[str], float]:
    """Runs in the DHT process: the revocation list it holds (checked when it was read from the DHT)."""
    access: AccessControl = node.protocol.authorizer.access
    return sorted(access.revoked), access.revocations_version


# --- refused peers: finding out why ---------------------------------------------------------------


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


def access_for(run_id: str, access_token: str, authority_key: str) -> AccessControl | None:
    """The access control of a peer from its options (None: a public swarm)."""
    if access_token and authority_key:
        raise UserError("give --authority-key (the monitor) or --access-token (other peers), not both")
    if authority_key:
        return AccessControl.for_authority(run_id, authority_key)
    if access_token:
        return AccessControl.for_token(run_id, access_token)
    return None


PUBLIC_SWARM = (
    "this peer has an access token, but the swarm at its initial peers does not check tokens (a public "
    "swarm, or another version): leave out --access-token"
)


def refused_message(reason: str) -> str:
    return reason if reason in (NO_TOKEN, PUBLIC_SWARM) else f"the swarm refused this peer: {reason}"


# --- wire messages --------------------------------------------------------------------------------


@functools.cache
def messages():
    """The two protobuf messages of the access check and handshake, built at first use."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="cotrain_access.proto", package="cotrain", syntax="proto3")
    req = fdp.message_type.add(name="AccessRequest")
    for number, (name, kind) in enumerate(
        [
            ("token", f.TYPE_BYTES),
            ("time", f.TYPE_DOUBLE),
            ("nonce", f.TYPE_BYTES),
            ("signature", f.TYPE_BYTES),
        ],
        1,
    ):
        req.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    rep = fdp.message_type.add(name="AccessReply")
    for number, (name, kind) in enumerate(
        [
            ("granted", f.TYPE_BOOL),
            ("reason", f.TYPE_STRING),
            ("token", f.TYPE_BYTES),
            ("nonce", f.TYPE_BYTES),
            ("signature", f.TYPE_BYTES),
        ],
        1,
    ):
        rep.field.add(name=name, number=number, type=kind, label=f.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)

    class Messages:
        AccessRequest = message_factory.GetMessageClass(pool.FindMessageTypeByName("cotrain.AccessRequest"))
        AccessReply = message_factory.GetMessageClass(pool.FindMessageTypeByName("cotrain.AccessReply"))

    return Messages
