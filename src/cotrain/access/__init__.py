"""Private swarms: access tokens and the checks that every DHT, averaging and state-download request passes.

Three layers, all keyed to the swarm's authority:

- DHT requests: hivemind's ``TokenAuthorizerBase`` with cotrain's tokens (cotrain.hivemind_ext.authorizer):
  signed, timestamped, never replayed, in both directions.
- Averaging and state download: cotrain.hivemind_ext.guard admits averaging, matchmaking and download
  requests only from peer ids that proved a valid token with a signed handshake, and proves its own before
  calling others.
- Revocation: the monitor holds the authority key (cotrain.access.authority), signs the list of revoked
  tokens and keeps it in the DHT; every process re-reads it every few seconds, and a DHT validator
  (cotrain.hivemind_ext.validators) refuses lists the authority did not sign.

Modules: crypto (RSA keys as hivemind signs), tokens (what a token says, its checks, the token file),
authority (the operator's key, registry and revocation list), commands (`cotrain token` as plain functions),
control (one peer's view: ``AccessControl``), voters (one vote per participant: records tied to a token),
possession (proofs that a peer holds its token's key), wire (the protocol's messages). This package decides;
the network sides live above it (cotrain.hivemind_ext's authorizer and guard, cotrain.net.probe: why a peer
was refused, the watcher of a running peer) and nothing here imports them.

The names below are imported on first use: `cotrain token` needs no hivemind, the peers' modules do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "PrivateKey": "crypto",
    "PublicKey": "crypto",
    "NO_TOKEN": "tokens",
    "TokenFile": "tokens",
    "check_token": "tokens",
    "fingerprints": "tokens",
    "read_token_file": "tokens",
    "DEFAULT_AUTHORITY_KEY": "authority",
    "Authority": "authority",
    "count_tokens": "authority",
    "registry_path": "authority",
    "verify_revocations": "authority",
    "Issued": "commands",
    "Revoked": "commands",
    "issue_token": "commands",
    "list_tokens": "commands",
    "revoke_tokens": "commands",
    "token_table": "commands",
    "AccessControl": "control",
    "Credential": "control",
    "access_for": "control",
}

__all__ = [
    "AccessControl",
    "Authority",
    "Credential",
    "DEFAULT_AUTHORITY_KEY",
    "Issued",
    "NO_TOKEN",
    "PrivateKey",
    "PublicKey",
    "Revoked",
    "TokenFile",
    "access_for",
    "check_token",
    "count_tokens",
    "fingerprints",
    "issue_token",
    "list_tokens",
    "read_token_file",
    "registry_path",
    "revoke_tokens",
    "token_table",
    "verify_revocations",
]

if TYPE_CHECKING:
    from cotrain.access.authority import (
        DEFAULT_AUTHORITY_KEY,
        Authority,
        count_tokens,
        registry_path,
        verify_revocations,
    )
    from cotrain.access.commands import Issued, Revoked, issue_token, list_tokens, revoke_tokens, token_table
    from cotrain.access.control import AccessControl, Credential, access_for
    from cotrain.access.crypto import PrivateKey, PublicKey
    from cotrain.access.tokens import NO_TOKEN, TokenFile, check_token, fingerprints, read_token_file


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'cotrain.access' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cotrain.access.{module}"), name)
