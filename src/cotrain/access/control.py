"""What one peer of a private swarm knows and decides: the authority's public key, its own credential, the
revoked tokens, and whether another peer's token grants access.

A copy of ``AccessControl`` lives in each of a peer's processes (the DHT's, the averagers'); the revocation
list it keeps in the DHT is guarded by cotrain.hivemind_ext.validators.RevocationsValidator.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.proto.auth_pb2 import AccessToken

from cotrain.access.authority import Authority, verify_revocations
from cotrain.access.crypto import PrivateKey, PublicKey
from cotrain.access.tokens import REVOKED, TokenFile, check_token, fingerprints, iso, read_token_file
from cotrain.errors import UserError
from cotrain.keys import revocations_key

logger = logging.getLogger(__name__)

OWN_TOKEN_RECHECK = 2.0  # seconds between checks that this peer's token file was replaced (renewed)
AUTHORITY_SELF_TOKEN_DAYS = 1.0


@dataclass
class Credential:
    """This peer's own token and the private key that proves it owns it."""

    name: str
    proto: AccessToken
    key: PrivateKey
    expiration: float


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
        self._authority_key = PublicKey.from_bytes(authority_public_key)
        self._revoked: frozenset[str] = frozenset()
        self.revocations_version = -1.0
        self.revocations_record: dict | None = None  # the newest list signed by the authority, as stored
        self._registry_mtime: float | None = None
        self._own: Credential | None = None
        self._own_mtime = 0.0
        self._own_checked = 0.0
        # signature -> (token bytes, expiry, fingerprints) of the valid tokens seen
        self._checked: dict[bytes, tuple[bytes, float, frozenset[str]]] = {}
        self._state_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_state_lock")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._state_lock = threading.Lock()

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

    @property
    def authority_key(self) -> PublicKey:
        """The swarm authority's public key, which signs tokens and revocation lists."""
        return self._authority_key

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
        same bytes) skips the signature check; its expiry and revocation are checked every time."""
        signature = token.signature if token is not None else b""
        known = self._checked.get(signature)
        if known is not None and known[0] == token.SerializeToString():
            if known[2] & self.revoked:
                return f"access token {token.username!r} {REVOKED}"
            if known[1] <= time.time():
                return f"access token {token.username!r} expired at {iso(known[1])}"
            return None
        reason = check_token(token, self._authority_key, self.revoked)
        if reason is None:
            if len(self._checked) > 1024:
                self._checked.clear()
            self._checked[signature] = (
                token.SerializeToString(),
                float(token.expiration_time),
                fingerprints(token),
            )
        return reason

    def _set_own(self, token: TokenFile, mtime: float) -> None:
        self._own = Credential(token.name, token.proto(), token.private_key, token.expiration)
        self._own_mtime = mtime

    def own(self) -> Credential:
        """This peer's credential: re-read when its token file is replaced (a renewed token needs no
        restart); the monitor signs its own, renewing it a while before it expires."""
        now = time.time()
        with self._state_lock:
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
        self.revocations_record = value
        if newly:
            more = f"{len(newly)} more revoked fingerprint{'' if len(newly) == 1 else 's'}"
            logger.debug(f"A newer revocation list: {more}")
        return True

    def merge_revocations(self, revoked: list[str], version: float) -> None:
        """Take the list this peer's own DHT process checked and holds."""
        if self.authority is None and version > self.revocations_version:
            self._revoked = frozenset(revoked) | self._revoked
            self.revocations_version = version


def access_for(run_id: str, access_token: str, authority_key: str) -> AccessControl | None:
    """The access control of a peer from its options (None: a public swarm)."""
    if access_token and authority_key:
        raise UserError("give --authority-key (the monitor) or --access-token (other peers), not both")
    if authority_key:
        return AccessControl.for_authority(run_id, authority_key)
    if access_token:
        return AccessControl.for_token(run_id, access_token)
    return None
