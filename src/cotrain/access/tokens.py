"""Access tokens of a private swarm: what a token says, the checks that grant access, and the token file.

A token is a file given to one participant: their name, an RSA key pair made for them, an expiry, the
authority's public key and the authority's signature over (name, public key, expiry). It is a credential:
whoever holds the file can join the swarm until it expires or is revoked, so it is written readable by its
owner only, and one readable by others is used with a warning (cotrain.privatefile).

A token is named by what the authority signed (``token_fingerprint``: a hash of the signed payload), so every
spelling of the same token has the same name and a revoked token stays revoked however it is re-encoded.
Revocation lists also carry the older name, a hash of the signature's text (``signature_fingerprint``), for
tokens registered before: it is sound only because a signature is accepted in one spelling only
(cotrain.access.crypto).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, ValidationError

from cotrain.access.crypto import PrivateKey, PublicKey, decode_signature
from cotrain.errors import UserError
from cotrain.privatefile import warn_if_exposed

TOKEN_FORMAT = "cotrain-access-token/1"
NO_TOKEN = (
    "no access token: this swarm is private; pass --access-token FILE (a token its operator issued with "
    "`cotrain token issue`)"
)
REVOKED = "was revoked by the swarm's operator"
FOREIGN = "was not issued by this swarm's authority"
MALFORMED = "the access token is malformed"

# each matched against a whole string (re.fullmatch: "$" would also match before a final newline)
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}"
NAME = re.compile(NAME_PATTERN)
NAME_RULE = "1-64 letters, digits and _.@- (starting with a letter or digit)"
EXPIRATION_PATTERN = r"[0-9]{1,12}"  # whole seconds since the epoch, as the authority signs them
FINGERPRINT_PATTERN = r"[0-9a-f]{24}"
MAX_PUBLIC_KEY = 2048  # characters of an OpenSSH RSA public key (8192 bits: ~1,400)
MAX_SIGNATURE = 1400  # characters of a base64 signature (8192 bits: 1,368)
MAX_PRIVATE_KEY = 8192  # characters of a PEM RSA private key (8192 bits: ~6,400)
MAX_TOKEN_FILE = 64 * 1024  # bytes


def is_name(value: object) -> bool:
    """Whether ``value`` is a token name: the whole string, nothing before or after (no final newline)."""
    return isinstance(value, str) and NAME.fullmatch(value) is not None


def whole_match(pattern: str, what: str) -> AfterValidator:
    """A pydantic validator of a string field: the whole string matches ``pattern``, else "must be what"."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if compiled.fullmatch(value) is None:
            raise ValueError(f"must be {what}")
        return value

    return AfterValidator(check)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def token_payload(name: str, public_key: bytes, expiration_time: str) -> bytes:
    """The bytes the authority signs: a token grants nothing but what they say."""
    return b"\n".join([TOKEN_FORMAT.encode(), name.encode(), public_key, expiration_time.encode()])


def token_fingerprint(name: str, public_key: bytes, expiration_time: str) -> str:
    """A token's name in revocation lists: a hash of what the authority signed, the same however the token's
    signature is spelled."""
    return hashlib.sha256(token_payload(name, public_key, expiration_time)).hexdigest()[:24]


def signature_fingerprint(signature: bytes) -> str:
    """The name registries before ``token_fingerprint`` gave a token: a hash of its signature's text."""
    return hashlib.sha256(signature).hexdigest()[:24]


def fingerprints(token) -> frozenset[str]:
    """Both names of ``token`` (a hivemind AccessToken) that a revocation list may carry."""
    return frozenset(
        (
            token_fingerprint(token.username, token.public_key, token.expiration_time),
            signature_fingerprint(token.signature),
        )
    )


def is_malformed(token) -> bool:
    """Whether ``token``'s fields are out of shape (checked before any signature work)."""
    return (
        not is_name(token.username)
        or not re.fullmatch(EXPIRATION_PATTERN, token.expiration_time)
        or len(token.public_key) > MAX_PUBLIC_KEY
        or len(token.signature) > MAX_SIGNATURE
    )


def check_token(token, authority_public_key, revoked: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why ``token`` (a hivemind AccessToken) does not grant access, in one sentence; None when it does.
    ``authority_public_key`` is a cotrain.access.crypto.PublicKey: a signature in any spelling but the
    canonical one is malformed."""
    if token is None or not token.signature or not token.public_key:
        return NO_TOKEN
    try:
        if is_malformed(token):
            return MALFORMED
        PublicKey.from_bytes(token.public_key)
        expiration = float(token.expiration_time)
        decode_signature(token.signature, authority_public_key.signature_size)
    except Exception:
        return MALFORMED
    name = token.username
    if not authority_public_key.verify(
        token_payload(name, token.public_key, token.expiration_time), token.signature
    ):
        return f"access token {name!r} {FOREIGN} (or was altered)"
    if fingerprints(token) & revoked:
        return f"access token {name!r} {REVOKED}"
    if expiration <= time.time():
        return f"access token {name!r} expired at {iso(expiration)}"
    return None


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
        return token_fingerprint(self.name, self.public_key, self.expiration_time)

    @property
    def signature_fingerprint(self) -> str:
        return signature_fingerprint(self.signature)

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


Name = Annotated[str, whole_match(NAME_PATTERN, NAME_RULE)]
PublicKeyText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PUBLIC_KEY)]


class TokenFileSchema(BaseModel):
    """A token file as ``TokenFile.to_json`` writes it: every field required, nothing else allowed."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal["cotrain-access-token/1"]
    name: Name
    issued: Annotated[str, StringConstraints(max_length=64)]
    expires: Annotated[str, StringConstraints(max_length=64)]
    expiration_time: Annotated[str, whole_match(EXPIRATION_PATTERN, "whole seconds since the epoch")]
    public_key: PublicKeyText
    authority_public_key: PublicKeyText
    signature: Annotated[str, StringConstraints(min_length=1, max_length=MAX_SIGNATURE)]
    private_key: Annotated[str, StringConstraints(min_length=1, max_length=MAX_PRIVATE_KEY)]


def schema_problems(error: ValidationError, limit: int = 3) -> str:
    """A pydantic error as one short line: ``field: problem; ...``."""
    parts = [
        f"{'.'.join(str(x) for x in e['loc']) or 'the file'}: {e['msg'].lower()}"
        for e in error.errors()[:limit]
    ]
    more = error.error_count() - limit
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def read_token_file(path: str | Path) -> TokenFile:
    """Read and check a token file (its schema and the authority's signature); raise UserError with one
    line."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_TOKEN_FILE + 1)
        if len(raw) > MAX_TOKEN_FILE:
            raise UserError(f"access token file {path} is not a cotrain token (over {MAX_TOKEN_FILE} bytes)")
        data = json.loads(raw.decode())
    except FileNotFoundError:
        raise UserError(f"access token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"access token file {path} is not a cotrain token ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != TOKEN_FORMAT:
        raise UserError(f"access token file {path} is not a cotrain token (expected format {TOKEN_FORMAT})")
    try:
        fields = TokenFileSchema.model_validate(data)
    except ValidationError as e:
        raise UserError(f"access token file {path} is damaged ({schema_problems(e)})") from None
    try:
        token = TokenFile(
            name=fields.name,
            public_key=fields.public_key.encode(),
            expiration=float(fields.expiration_time),
            signature=fields.signature.encode(),
            authority_public_key=fields.authority_public_key.encode(),
            private_key=PrivateKey.from_pem(fields.private_key.encode()),
        )
        authority = PublicKey.from_bytes(token.authority_public_key)
        PublicKey.from_bytes(token.public_key)
        own_public = token.private_key.get_public_key().to_bytes()
    except Exception as e:
        raise UserError(f"access token file {path} is damaged ({type(e).__name__}: {e})") from None
    if own_public != token.public_key:
        raise UserError(f"access token file {path} is damaged: its key pair does not match its public key")
    try:
        decode_signature(token.signature, authority.signature_size)
    except ValueError as e:
        raise UserError(f"access token file {path} is damaged ({e}); ask for the file again") from None
    if not authority.verify(
        token_payload(token.name, token.public_key, token.expiration_time), token.signature
    ):
        raise UserError(
            f"access token file {path} is not validly signed by its authority (altered or forged)"
        )
    warn_if_exposed(path, "access token file")  # a token in use that others may have read
    return token
