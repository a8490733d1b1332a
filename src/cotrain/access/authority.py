"""The swarm operator's authority: its signing key, the registry of the tokens it issued, and the signed list
of revoked tokens.

The operator keeps an *authority key* (an RSA key, ``authority.key`` by default) next to a registry of the
tokens it issued (``authority.tokens.json``). Revoking a name marks its tokens in the registry; the monitor
signs the list of revoked tokens with the authority key and publishes it to the swarm.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from cotrain.access.crypto import PrivateKey
from cotrain.access.tokens import TokenFile, token_payload, write_private
from cotrain.errors import UserError

REGISTRY_FORMAT = "cotrain-token-registry/1"
DEFAULT_AUTHORITY_KEY = "authority.key"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
MAX_VALID_DAYS = 3650.0


def registry_path(key_path: str | Path) -> Path:
    key_path = Path(key_path)
    return key_path.with_name(f"{key_path.stem}.tokens.json")


def revocations_payload(revoked: list[str], version: float, expires: float) -> bytes:
    body = json.dumps({"revoked": sorted(revoked), "version": version, "expires": expires}, sort_keys=True)
    return b"cotrain-revocations/1\n" + body.encode()


def verify_revocations(value: object, authority_public_key, expiration: float | None = None) -> bool:
    """Whether a revocation list read from the DHT was signed by the authority (and, when the record's
    expiration is given, for exactly that expiration, so an old list cannot be stored again to outlive a
    newer one)."""
    if not isinstance(value, dict):
        return False
    try:
        revoked, version, expires = list(value["revoked"]), float(value["version"]), float(value["expires"])
        if not all(isinstance(r, str) for r in revoked):
            return False
        if expiration is not None and expires != expiration:
            return False
        return bool(
            authority_public_key.verify(revocations_payload(revoked, version, expires), value["signature"])
        )
    except Exception:
        return False


class Authority:
    """The swarm operator's signing key and the registry of the tokens it issued."""

    def __init__(self, key_path: str | Path, private_key) -> None:
        self.key_path = Path(key_path)
        self.private_key = private_key
        self.public_key = private_key.get_public_key()
        self.public_key_bytes = self.public_key.to_bytes()

    @property
    def registry_path(self) -> Path:
        return registry_path(self.key_path)

    @classmethod
    def load(cls, key_path: str | Path, create: bool = False) -> Authority:
        key_path = Path(key_path)
        if not key_path.exists():
            if not create:
                raise UserError(
                    f"authority key {key_path} does not exist: create it with "
                    f"`cotrain token issue --authority-key {key_path} --name NAME`"
                )
            key = PrivateKey()
            write_private(key_path, key.to_pem())
            return cls(key_path, key)
        try:
            return cls(key_path, PrivateKey.from_pem(key_path.read_bytes()))
        except Exception as e:
            raise UserError(
                f"authority key {key_path} is not a PEM private key ({type(e).__name__})"
            ) from None

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def mint(self, name: str, private_key, expiration: float) -> TokenFile:
        public = private_key.get_public_key().to_bytes()
        expiration = float(int(expiration))
        signature = self.sign(token_payload(name, public, str(int(expiration))))
        return TokenFile(name, public, expiration, signature, self.public_key_bytes, private_key, time.time())

    # --- the registry ---------------------------------------------------------------------------

    def entries(self) -> list[dict]:
        path = self.registry_path
        if not path.exists():
            return []
        try:
            data = json.loads(path.read_text())
            assert data.get("format") == REGISTRY_FORMAT
            return list(data["tokens"])
        except Exception:
            raise UserError(
                f"token registry {path} is damaged; it lists the tokens issued with this key"
            ) from None

    def _save(self, entries: list[dict]) -> None:
        body = json.dumps({"format": REGISTRY_FORMAT, "tokens": entries}, indent=1).encode() + b"\n"
        write_private(self.registry_path, body)

    def issue(self, name: str, valid_days: float, out: str | Path) -> TokenFile:
        if not NAME.match(name):
            raise UserError(
                f"token name {name!r}: use 1-64 letters, digits and _.@- (starting with a letter)"
            )
        if not 0 < valid_days <= MAX_VALID_DAYS:
            raise UserError(f"--valid-days must be between 0 and {MAX_VALID_DAYS:g}, got {valid_days:g}")
        token = self.mint(name, PrivateKey(), time.time() + valid_days * 86400)
        entries = self.entries()
        entries.append(
            {
                "name": name,
                "fingerprint": token.fingerprint,
                "issued": token.issued,
                "expires": token.expiration,
                "revoked": None,
            }
        )
        write_private(Path(out), token.to_json())
        self._save(entries)
        return token

    def revoke(self, name: str) -> list[dict]:
        """Revoke every token issued to ``name``; return the entries revoked now."""
        entries = self.entries()
        mine = [e for e in entries if e["name"] == name]
        if not mine:
            raise UserError(
                f"no token was issued to {name!r} with {self.key_path} (see `cotrain token list`)"
            )
        now = time.time()
        newly = [e for e in mine if e["revoked"] is None]
        for e in newly:
            e["revoked"] = now
        if newly:
            self._save(entries)
        return newly

    def revoked_fingerprints(self) -> set[str]:
        """Revoked tokens that have not expired yet (expired ones are refused anyway)."""
        now = time.time()
        return {e["fingerprint"] for e in self.entries() if e["revoked"] is not None and e["expires"] > now}

    def signed_revocations(self, expires: float) -> dict:
        revoked = sorted(self.revoked_fingerprints())
        version = time.time()
        signature = self.sign(revocations_payload(revoked, version, expires))
        return {"revoked": revoked, "version": version, "expires": expires, "signature": signature}
