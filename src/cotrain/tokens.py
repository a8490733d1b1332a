"""Access tokens of a private swarm and `cotrain token` (issue, revoke, list).

The swarm's operator keeps an *authority key* (an RSA key, ``authority.key`` by default) next to a registry of
the tokens it issued (``authority.tokens.json``). A token is a file given to one participant: their name, an
RSA key pair made for them, an expiry, the authority's public key and the authority's signature over (name,
public key, expiry). It is a credential: whoever holds the file can join the swarm until it expires or is
revoked, so it is written readable by its owner only. Revoking a name marks its tokens in the registry; the
monitor signs the list of revoked tokens with the authority key and publishes it to the swarm.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cotrain.errors import UserError

TOKEN_FORMAT = "cotrain-access-token/1"
REGISTRY_FORMAT = "cotrain-token-registry/1"
DEFAULT_AUTHORITY_KEY = "authority.key"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
MAX_VALID_DAYS = 3650.0
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


def revocations_payload(revoked: list[str], version: float, expires: float) -> bytes:
    body = json.dumps({"revoked": sorted(revoked), "version": version, "expires": expires}, sort_keys=True)
    return b"cotrain-revocations/1\n" + body.encode()


class PublicKey:
    """An RSA public key, as hivemind's ``RSAPublicKey`` writes and checks them (OpenSSH bytes; PSS-SHA256
    signatures in base64), without importing hivemind: `cotrain token` stays quick."""

    def __init__(self, key) -> None:
        self._key = key

    @classmethod
    def from_bytes(cls, data: bytes) -> PublicKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = serialization.load_ssh_public_key(data)
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError("not an RSA key")
        return cls(key)

    def to_bytes(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    def verify(self, data: bytes, signature: bytes) -> bool:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import hashes

        try:
            self._key.verify(base64.b64decode(signature), data, _pss(), hashes.SHA256())
            return True
        except (ValueError, TypeError, exceptions.InvalidSignature):
            return False


class PrivateKey:
    """An RSA private key that signs as hivemind's ``RSAPrivateKey`` does (and stands in for it)."""

    def __init__(self, key=None) -> None:
        if key is None:
            from cryptography.hazmat.primitives.asymmetric import rsa

            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self._key = key

    @classmethod
    def from_pem(cls, data: bytes) -> PrivateKey:
        from cryptography.hazmat.primitives import serialization

        return cls(serialization.load_pem_private_key(data, password=None))

    def to_pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return self._key.private_bytes(
            encoding=serialization.Encoding.PEM,
            format=serialization.PrivateFormat.PKCS8,
            encryption_algorithm=serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes

        return base64.b64encode(self._key.sign(data, _pss(), hashes.SHA256()))

    def get_public_key(self) -> PublicKey:
        return PublicKey(self._key.public_key())

    def __getstate__(self) -> dict:
        return {"pem": self.to_pem()}

    def __setstate__(self, state: dict) -> None:
        self._key = PrivateKey.from_pem(state["pem"])._key


def _pss():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


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


def registry_path(key_path: str | Path) -> Path:
    key_path = Path(key_path)
    return key_path.with_name(f"{key_path.stem}.tokens.json")


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


# --- the command line -----------------------------------------------------------------------------

DESCRIPTION = (
    "Private swarms: issue, revoke and list the signed access tokens that let participants join "
    "(the monitor runs with --authority-key, the others with --access-token)."
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help=DESCRIPTION, description=DESCRIPTION)
    actions = p.add_subparsers(dest="token_action", metavar="ACTION", required=True)

    def key_option(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--authority-key",
            default=DEFAULT_AUTHORITY_KEY,
            metavar="FILE",
            help=f"the swarm's authority key (default: {DEFAULT_AUTHORITY_KEY}); the registry of issued "
            f"tokens is kept next to it (authority.key: authority.tokens.json)",
        )

    q = actions.add_parser(
        "issue",
        help="sign a token for a participant and write it to a file (creates the authority key if missing)",
        description="Sign an access token for one participant and write it to a file for them.",
    )
    q.add_argument("--name", required=True, help="who the token is for (shown in logs and `token list`)")
    q.add_argument(
        "--valid-days", type=float, default=30.0, metavar="DAYS", help="days until it expires (default: 30)"
    )
    q.add_argument("--output", "-o", metavar="FILE", help="token file to write (default: NAME.token)")
    key_option(q)
    q = actions.add_parser(
        "revoke",
        help="revoke every token of a participant; the running monitor tells the swarm within seconds",
        description="Revoke every token issued to a participant. A running monitor publishes the revocation "
        "to the swarm; peers refuse the revoked tokens from then on.",
    )
    q.add_argument("--name", required=True, help="whose tokens to revoke")
    key_option(q)
    q = actions.add_parser("list", help="list the issued tokens", description="List the issued tokens.")
    q.add_argument("--json", action="store_true", help="one JSON object per token")
    key_option(q)


def run(ns: argparse.Namespace) -> int:
    action = ns.token_action
    if action == "issue":
        created = not Path(ns.authority_key).exists()
        authority = Authority.load(ns.authority_key, create=True)
        if created:
            print(f"created authority key {ns.authority_key} (keep it secret; the monitor runs with it)")
        out = Path(ns.output or f"{ns.name}.token")
        token = authority.issue(ns.name, ns.valid_days, out)
        print(f"issued token {token.fingerprint} for {ns.name!r}, valid until {iso(token.expiration)}: {out}")
        return 0
    authority = Authority.load(ns.authority_key)
    if action == "revoke":
        newly = authority.revoke(ns.name)
        if newly:
            print(
                f"revoked {len(newly)} token(s) of {ns.name!r}; a running monitor tells the swarm within "
                "seconds"
            )
        else:
            print(f"the tokens of {ns.name!r} were already revoked")
        return 0
    now = time.time()
    rows = []
    for e in authority.entries():
        status = "revoked" if e["revoked"] is not None else ("expired" if e["expires"] <= now else "valid")
        rows.append({**e, "status": status})
    if ns.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print(f"no tokens issued with {ns.authority_key}")
        return 0
    print(f"{'name':<20}{'token':<26}{'status':<9}{'expires':<25}")
    for row in rows:
        print(f"{row['name']:<20}{row['fingerprint']:<26}{row['status']:<9}{iso(row['expires']):<25}")
    return 0
