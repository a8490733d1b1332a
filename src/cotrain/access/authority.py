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

The registry file is checked whole (JSON of at most 64 MiB, its format, a list of tokens, nothing else) and
each entry on its own: an entry that does not fit (a name that is no token name, a field of the wrong type) is
skipped with a warning naming it, so the others can still be listed and revoked. A skipped entry is kept in
the file as it is, and where it says it was revoked, every fingerprint it holds stays in the revocation list.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from cotrain.access.crypto import PrivateKey
from cotrain.access.tokens import (
    FINGERPRINT_PATTERN,
    NAME_RULE,
    Name,
    TokenFile,
    is_name,
    schema_problems,
    token_payload,
    whole_match,
)
from cotrain.errors import UserError
from cotrain.privatefile import warn_if_exposed, write_private

logger = logging.getLogger(__name__)

REGISTRY_FORMAT = "cotrain-token-registry/2"
REGISTRY_FORMAT_1 = "cotrain-token-registry/1"
DEFAULT_AUTHORITY_KEY = "authority.key"
MAX_VALID_DAYS = 3650.0
MAX_REVOKED = 100_000  # fingerprints in one revocation list
MAX_REGISTRY_BYTES = 64 << 20  # an entry takes about 200 bytes: room for 300,000 tokens

Fingerprint = Annotated[str, whole_match(FINGERPRINT_PATTERN, "24 lowercase hex digits")]


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
    """The registry file; each of its tokens is checked on its own (``Entry``, ``EntryFormat1``)."""

    format: Literal["cotrain-token-registry/2", "cotrain-token-registry/1"]
    tokens: list[Any]


class EntryFormat1(_Schema):
    name: Name
    fingerprint: Fingerprint  # of the signature's text
    issued: float
    expires: float
    revoked: float | None


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


@dataclass
class Skipped:
    """A registry entry that did not pass its schema, as the file holds it: written back as it is (revoking
    its name sets its ``revoked``), never dropped."""

    raw: Any

    @property
    def name(self) -> object:
        return self.raw.get("name") if isinstance(self.raw, dict) else None

    def revoked_fingerprints(self) -> set[str]:
        """The fingerprints it holds, where it says it was revoked (anything but null): its token stays
        revoked."""
        if not isinstance(self.raw, dict) or self.raw.get("revoked") is None:
            return set()
        found = (self.raw.get(key) for key in ("fingerprint", "signature_fingerprint"))
        return {f for f in found if isinstance(f, str) and re.fullmatch(FINGERPRINT_PATTERN, f)}


def _describe(index: int, entry: Skipped) -> str:
    """A skipped registry entry, for a log line: its position and, where it has one, its name (quoted, so that
    a newline or a control character shows as an escape)."""
    return f"entry {index + 1}" + (f" (name {repr(entry.name)[:80]})" if entry.name is not None else "")


def count_tokens(count: int, kind: str = "") -> str:
    """``count`` tokens in words, ``kind`` before the noun: "1 token", "2 revoked tokens"."""
    return f"{count} {kind + ' ' if kind else ''}token{'' if count == 1 else 's'}"


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
        self._told_skipped: set[str] = set()

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
            key = PrivateKey.from_pem(key_path.read_bytes())
        except Exception as e:
            raise UserError(
                f"authority key {key_path} is not a PEM private key ({type(e).__name__})"
            ) from None
        warn_if_exposed(key_path, "authority key")  # a key in use that others may have read
        return cls(key_path, key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def mint(self, name: str, private_key, expiration: float) -> TokenFile:
        public = private_key.get_public_key().to_bytes()
        expiration = float(int(expiration))
        signature = self.sign(token_payload(name, public, str(int(expiration))))
        return TokenFile(name, public, expiration, signature, self.public_key_bytes, private_key, time.time())

    # --- the registry ---------------------------------------------------------------------------

    def entries(self) -> list[dict]:
        """The registry's entries that pass their schema (each as format 2), oldest first."""
        return [e for e in self._read() if isinstance(e, dict)]

    def _read(self) -> list[dict | Skipped]:
        """The registry's entries in its order: each as format 2, or, where it does not pass its schema, as
        ``Skipped`` (with a warning). A registry file that is not one raises UserError."""
        path = self.registry_path
        damaged = f"token registry {path} is damaged; it lists the tokens issued with this key"
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_REGISTRY_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise UserError(f"token registry {path} cannot be read ({type(e).__name__})") from None
        if len(raw) > MAX_REGISTRY_BYTES:
            raise UserError(f"{damaged} (over {MAX_REGISTRY_BYTES >> 20} MiB)")
        try:
            data = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise UserError(f"{damaged} (not JSON)") from None
        try:
            registry = Registry.model_validate(data)
        except ValidationError as e:
            raise UserError(f"{damaged} ({schema_problems(e)})") from None
        schema = EntryFormat1 if registry.format == REGISTRY_FORMAT_1 else Entry
        tokens: list[dict | Skipped] = []
        for index, raw_entry in enumerate(registry.tokens):
            try:
                entry = schema.model_validate(raw_entry)
            except ValidationError as e:
                tokens.append(Skipped(raw_entry))
                self._tell_skipped(index, tokens[-1], schema_problems(e, limit=1))
                continue
            tokens.append(_from_format_1(entry) if isinstance(entry, EntryFormat1) else entry.model_dump())
        self._tell_older_names([e for e in tokens if isinstance(e, dict)])
        return tokens

    def _tell_skipped(self, index: int, entry: Skipped, problem: str) -> None:
        """Say once per entry that it is skipped, and why."""
        told = f"{index}:{json.dumps(entry.raw, sort_keys=True)}"
        if told in self._told_skipped:
            return
        self._told_skipped.add(told)
        logger.warning(
            f"Token registry {self.registry_path}: skipping {_describe(index, entry)}, which is not a "
            f"token's ({problem}); the other tokens are listed and revoked as usual"
        )

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

    def _save(self, tokens: list[dict | Skipped]) -> None:
        """Write the registry (a skipped entry as it was: never dropped)."""
        raw = [e.raw if isinstance(e, Skipped) else e for e in tokens]
        body = json.dumps({"format": REGISTRY_FORMAT, "tokens": raw}, indent=1).encode() + b"\n"
        write_private(self.registry_path, body)

    def issue(self, name: str, valid_days: float, out: str | Path) -> TokenFile:
        if not is_name(name):
            raise UserError(f"token name {name!r}: use {NAME_RULE}")
        if not 0 < valid_days <= MAX_VALID_DAYS:
            raise UserError(f"--valid-days must be between 0 and {MAX_VALID_DAYS:g}, got {valid_days:g}")
        token = self.mint(name, PrivateKey(), time.time() + valid_days * 86400)
        tokens = self._read()
        tokens.append(
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
        self._save(tokens)
        return token

    def revoke(self, name: str) -> list[dict]:
        """Revoke every token issued to ``name``; return the entries revoked now. A skipped entry (see the
        module's doc) of that name is marked revoked too: its fingerprints join the revocation list."""
        tokens = self._read()
        mine = [e for e in tokens if isinstance(e, dict) and e["name"] == name]
        mine += [
            e.raw for e in tokens if isinstance(e, Skipped) and e.name == name and isinstance(e.raw, dict)
        ]
        if not mine:
            raise UserError(
                f"no token was issued to {name!r} with {self.key_path} (see `cotrain token list`)"
            )
        now = time.time()
        newly = [e for e in mine if e.get("revoked") is None]
        for e in newly:
            e["revoked"] = now
        if newly:
            self._save(tokens)
        return newly

    def revoked_tokens(self) -> list[set[str]]:
        """The tokens of the revocation list, each as the set of its names: every revoked token that has not
        expired yet (expired ones are refused anyway), by both its names, and every skipped entry marked
        revoked, by the names it holds (its expiry cannot be trusted)."""
        now = time.time()
        tokens: list[set[str]] = []
        for e in self._read():
            if isinstance(e, Skipped):
                names = e.revoked_fingerprints()
            elif e["revoked"] is not None and e["expires"] > now:
                names = {n for n in (e["fingerprint"], e["signature_fingerprint"]) if n}
            else:
                continue
            if names:
                tokens.append(names)
        return tokens

    def revoked_fingerprints(self) -> set[str]:
        """Every name of every token in the revocation list (``revoked_tokens``): what peers refuse."""
        return set().union(*self.revoked_tokens())

    def signed_revocations(self, expires: float) -> dict:
        revoked = sorted(self.revoked_fingerprints())
        version = time.time()
        signature = self.sign(revocations_payload(revoked, version, expires))
        return {"revoked": revoked, "version": version, "expires": expires, "signature": signature}
