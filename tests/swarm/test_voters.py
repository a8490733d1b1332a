"""One vote per participant in a private swarm (cotrain.access.voters).

Here, with hivemind in the test process; the rest in tests/unit/access/test_voters.py."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from cotrain.access.voters import (
    make_voter_record,
    read_voters,
    verify_voter,
    voters_validators,
)
from cotrain.keys import voters_key
from support.voters import RUN


@pytest.mark.timeout(60)
def test_voter_records_pass_the_dht_and_read_back_by_signing_key(swarm):
    run_key = RSAPrivateKey()
    validator = RSASignatureValidator(run_key)
    dht = hivemind.DHT(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[*voters_validators(RUN), validator],
        nat_port_map=False,
        start=True,
    )
    try:
        bob = swarm["holders"]["bob"]
        record = make_voter_record(bob, validator.local_public_key)
        assert dht.store(
            voters_key(RUN), record.dict(), get_dht_time() + 30, subkey=validator.local_public_key
        )
        # an oversized one is refused by the DHT's schema
        big = {"token": b"x" * 10_000, "proof": record.proof}
        assert not dht.store(voters_key(RUN), big, get_dht_time() + 30, subkey=validator.local_public_key)
        found = read_voters(dht, swarm["reader"])
        assert list(found) == [validator.local_public_key]
        bobs = verify_voter(
            swarm["reader"], swarm["keys"]["bob"][0], swarm["records"][swarm["keys"]["bob"][0]]
        )
        assert found[validator.local_public_key] == bobs  # the same participant as bob's other key
    finally:
        dht.shutdown()
