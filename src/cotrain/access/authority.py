"""The swarm operator's authority: its signing key, the registry of the tokens it issued, and the signed list
of revoked tokens.

The operator keeps an *authority key* (an RSA key, ``authority.key`` by default) next to a registry of the
tokens it issued (``authority.tokens.json``). Revoking a name marks its tokens in the registry; the monitor
signs the list of revoked tokens with the authority key and publishes it to the swarm.

The registry names each token twice: ``fingerprint``, a hash of what the authority signed (every spelling of
the token has it), and ``signature_fingerprint``, a hash of its signature's text (the only name registries of
format 1 kept). A registry of format 1 is read as format 2 with no ``fingerprint``: it did not keep the public
keys that the new name needs, so its revoked tokens stay revoked under their signature's name (peers accept a
signature in its one canonical spelling only, which keeps that name sound). It is written as format 2 on its
next change.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError

from cotrain.access.crypto import PrivateKey
from cotrain.access.tokens import (
    FINGERPRINT_PATTERN,
    NAME,
    Name,
    TokenFile,
    schema_problems,
    token_payload,
    write_private,
)
from cotrain.errors import UserError

logger = logging.getLogger(__name__)

REGISTRY_FORMAT = "cotrain-token-registry/2"
REGISTRY_FORMAT_1 = "cotrain-token-registry/1"
DEFAULT_AUTHORITY_KEY = "authority.key"
MAX_VALID_DAYS = 3650.0
MAX_REVOKED = 100_000  # fingerprints in one revocation list

Fingerprint = Annotated[str, StringConstraints(pattern=FINGERPRINT_PATTERN)]


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Entry(_Schema):
    """One issued token in the registry."""

    name: Name
    fingerprint: Fingerprint | None  # None: registered in format 1 (see the module's doc)
    signature_fingerprint: Fingerprint
    issued: float
    expires: float
    revoked: float | None


class Registry(_Schema):
    format: Literal["cotrain-token-registry/2"]
    tokens: list[Entry]


class EntryFormat1(_Schema):
    name: Name
    fingerprint: Fingerprint  # of the signature's text
    issued: float
    expires: float
    revoked: float | None


class RegistryFormat1(_Schema):
    format: Literal["cotrain-token-registry/1"]
    tokens: list[EntryFormat1]


def _from_format_1(entry: EntryFormat1) -> dict:
    """A format-1 entry as format 2: its fingerprint was of the signature's text."""
    return Entry(
        name=entry.name,
        fingerprint=None,
        signature_fingerprint=entry.fingerprint,
        issued=entry.issued,
        expires=entry.expires,
        revoked=entry.revoked,
    ).model_dump()


def token_name(entry: dict) -> str:
    """The fingerprint `cotrain token list` shows for a registry entry."""
    return entry["fingerprint"] or entry["signature_fingerprint"]


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
        if len(revoked) > MAX_REVOKED or not all(isinstance(r, str) and len(r) <= 64 for r in revoked):
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
        self._told_format_1 = False

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
        try:
            text = path.read_text()
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"token registry {path} cannot be read ({type(e).__name__})") from None
        damaged = f"token registry {path} is damaged; it lists the tokens issued with this key"
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise UserError(f"{damaged} (not JSON)") from None
        try:
            if isinstance(data, dict) and data.get("format") == REGISTRY_FORMAT_1:
                entries = [_from_format_1(e) for e in RegistryFormat1.model_validate(data).tokens]
            else:
                entries = [e.model_dump() for e in Registry.model_validate(data).tokens]
        except ValidationError as e:
            raise UserError(f"{damaged} ({schema_problems(e)})") from None
        self._tell_older_names(entries)
        return entries

    def _tell_older_names(self, entries: list[dict]) -> None:
        """Say once which revoked tokens only a format-1 name (of the signature's text) keeps revoked."""
        now = time.time()
        older = sorted(
            {
                e["name"]
                for e in entries
                if e["fingerprint"] is None and e["revoked"] is not None and e["expires"] > now
            }
        )
        if older and not self._told_format_1:
            self._told_format_1 = True
            logger.warning(
                f"Token registry {self.registry_path} holds tokens registered in format 1: the revoked, "
                f"unexpired tokens of {', '.join(older)} stay revoked by their signature's fingerprint (the "
                "registry lacks what their content fingerprint needs)"
            )

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
                "signature_fingerprint": token.signature_fingerprint,
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
        """Both names of every revoked token that has not expired yet (expired ones are refused anyway)."""
        now = time.time()
        names: set[str] = set()
        for e in self.entries():
            if e["revoked"] is not None and e["expires"] > now:
                names.update(n for n in (e["fingerprint"], e["signature_fingerprint"]) if n)
        return names

    def signed_revocations(self, expires: float) -> dict:
        revoked = sorted(self.revoked_fingerprints())
        version = time.time()
        signature = self.sign(revocations_payload(revoked, version, expires))
        return {"revoked": revoked, "version": version, "expires": expires, "signature": signature}
