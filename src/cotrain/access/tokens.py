"""Access tokens of a private swarm: what a token says, the checks that grant access, and the token file.

A token is a file given to one participant: their name, an RSA key pair made for them, an expiry, the
authority's public key and the authority's signature over (name, public key, expiry). It is a credential:
whoever holds the file can join the swarm until it expires or is revoked, so it is written readable by its
owner only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cotrain.access.crypto import PrivateKey, PublicKey
from cotrain.errors import UserError

TOKEN_FORMAT = "cotrain-access-token/1"
NO_TOKEN = (
    "no access token: this swarm is private; pass --access-token FILE (a token its operator issued with "
    "`cotrain token issue`)"
)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def token_payload(name: str, public_key: bytes, expiration_time: str) -> bytes:
    """The bytes the authority signs: a token grants nothing but what they say."""
    return b"\n".join([TOKEN_FORMAT.encode(), name.encode(), public_key, expiration_time.encode()])


def fingerprint(signature: bytes) -> str:
    """A short, unique name for one issued token (revocation lists carry these)."""
    return hashlib.sha256(signature).hexdigest()[:24]


def check_token(token, authority_public_key, revoked: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why ``token`` (a hivemind AccessToken) does not grant access, in one sentence; None when it does."""
    if token is None or not token.signature or not token.public_key:
        return NO_TOKEN
    try:
        PublicKey.from_bytes(token.public_key)
        expiration = float(token.expiration_time)
    except Exception:
        return "the access token is malformed"
    name = token.username
    if not authority_public_key.verify(
        token_payload(name, token.public_key, token.expiration_time), token.signature
    ):
        return f"access token {name!r} was not issued by this swarm's authority (or was altered)"
    if fingerprint(token.signature) in revoked:
        return f"access token {name!r} was revoked by the swarm's operator"
    if expiration <= time.time():
        return f"access token {name!r} expired at {iso(expiration)}"
    return None


def write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only: a temp file first, then a rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class TokenFile:
    """A participant's token as its file holds it."""

    name: str
    public_key: bytes
    expiration: float
    signature: bytes
    authority_public_key: bytes
    private_key: PrivateKey
    issued: float = 0.0

    @property
    def expiration_time(self) -> str:
        return str(int(self.expiration))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.signature)

    def proto(self):
        from hivemind.proto.auth_pb2 import AccessToken

        return AccessToken(
            username=self.name,
            public_key=self.public_key,
            expiration_time=self.expiration_time,
            signature=self.signature,
        )

    def to_json(self) -> bytes:
        return (
            json.dumps(
                {
                    "format": TOKEN_FORMAT,
                    "name": self.name,
                    "issued": iso(self.issued),
                    "expires": iso(self.expiration),
                    "expiration_time": self.expiration_time,
                    "public_key": self.public_key.decode(),
                    "authority_public_key": self.authority_public_key.decode(),
                    "signature": self.signature.decode(),
                    "private_key": self.private_key.to_pem().decode(),
                },
                indent=1,
            ).encode()
            + b"\n"
        )


def read_token_file(path: str | Path) -> TokenFile:
    """Read and check a token file (format and the authority's signature); raise UserError with one line."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"access token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"access token file {path} is not a cotrain token ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != TOKEN_FORMAT:
        raise UserError(f"access token file {path} is not a cotrain token (expected format {TOKEN_FORMAT})")
    try:
        token = TokenFile(
            name=str(data["name"]),
            public_key=data["public_key"].encode(),
            expiration=float(data["expiration_time"]),
            signature=data["signature"].encode(),
            authority_public_key=data["authority_public_key"].encode(),
            private_key=PrivateKey.from_pem(data["private_key"].encode()),
        )
        authority = PublicKey.from_bytes(token.authority_public_key)
        own_public = token.private_key.get_public_key().to_bytes()
    except Exception as e:
        raise UserError(f"access token file {path} is damaged ({type(e).__name__}: {e})") from None
    if own_public != token.public_key:
        raise UserError(f"access token file {path} is damaged: its key pair does not match its public key")
    if not authority.verify(
        token_payload(token.name, token.public_key, token.expiration_time), token.signature
    ):
        raise UserError(
            f"access token file {path} is not validly signed by its authority (altered or forged)"
        )
    return token
