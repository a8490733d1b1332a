"""Helpers the test_voters tests share across suites."""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from cotrain.access import AccessControl, issue_token
from cotrain.access.voters import (
    make_voter_record,
)

RUN = "voters-test"


def signer() -> bytes:
    """A new RSA key's record subkey, as a process signs its records with (any process can make more)."""
    return RSASignatureValidator(RSAPrivateKey()).local_public_key


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An authority (the monitor's view) and tokens for alice (an insider with five keys), bob and carol."""
    root: Path = tmp_path_factory.mktemp("voters")
    key = root / "authority.key"
    holders = {name: AccessControl.for_token(RUN, str(issue_token(key, name, 1, root / f"{name}.token").path))
               for name in ("alice", "bob", "carol")}  # fmt: skip
    keys = {"alice": [signer() for _ in range(5)], "bob": [signer()], "carol": [signer()]}
    records = {k: make_voter_record(holders[name], k) for name, ks in keys.items() for k in ks}
    reader = AccessControl.for_authority(RUN, str(key))
    return {"root": root, "key": key, "holders": holders, "keys": keys, "records": records, "reader": reader}
