"""`cotrain token issue/revoke/list` as plain functions: the CLI parses the options, calls these and prints
what they return."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from cotrain.access.authority import Authority, token_name
from cotrain.access.tokens import TokenFile, iso


@dataclass
class Issued:
    token: TokenFile
    path: Path
    created_authority: bool  # the authority key did not exist and was made now

    @property
    def expires(self) -> str:
        return iso(self.token.expiration)


def issue_token(authority_key: str | Path, name: str, valid_days: float, output: str | Path | None) -> Issued:
    """Sign a token for ``name`` and write it to ``output`` (default ``NAME.token``), creating the authority
    key when it does not exist yet."""
    created = not Path(authority_key).exists()
    authority = Authority.load(authority_key, create=True)
    out = Path(output or f"{name}.token")
    return Issued(authority.issue(name, valid_days, out), out, created)


@dataclass
class Revoked:
    now: int  # tokens of the name revoked by this call (0: all were revoked before)
    listed: int  # tokens in the revocation list after it, as the monitor counts them when it publishes it


def revoke_tokens(authority_key: str | Path, name: str) -> Revoked:
    """Revoke every token issued to ``name``; how many were revoked now and how many the revocation list
    holds (every revoked token not expired yet, of any name)."""
    authority = Authority.load(authority_key)
    now = len(authority.revoke(name))
    return Revoked(now, len(authority.revoked_tokens()))


def list_tokens(authority_key: str | Path) -> list[dict]:
    """The registry's entries, each with its ``status``: valid, expired or revoked."""
    now = time.time()
    rows = []
    for e in Authority.load(authority_key).entries():
        status = "revoked" if e["revoked"] is not None else ("expired" if e["expires"] <= now else "valid")
        rows.append({**e, "status": status})
    return rows


def token_table(rows: list[dict]) -> list[str]:
    """``list_tokens``'s rows as the lines of a table (a token registered in format 1 shows the fingerprint
    of its signature, the only one its registry kept)."""
    lines = [f"{'name':<20}{'fingerprint':<26}{'status':<9}expires"]
    for row in rows:
        lines.append(f"{row['name']:<20}{token_name(row):<26}{row['status']:<9}{iso(row['expires'])}")
    return lines
