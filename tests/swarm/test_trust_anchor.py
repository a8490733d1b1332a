"""The address is the trust anchor.

Here, with hivemind in the test process; the rest in tests/live/test_trust_anchor.py and
tests/unit/net/test_trust_anchor.py."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from conftest import LOCALHOST
from cotrain.net.configrecord import make_record
from cotrain.net.vouch import (
    ask_initial_peers,
    serve_config,
)
from support.trust_anchor import RUN, run_fields


@pytest.mark.timeout(60)
def test_a_peer_answers_with_the_record_it_serves_and_silent_peers_are_skipped():
    server = hivemind.DHT(host_maddrs=[LOCALHOST], nat_port_map=False, start=True)
    address = [str(a) for a in server.get_visible_maddrs()]
    silent = hivemind.DHT(initial_peers=address, host_maddrs=[LOCALHOST], nat_port_map=False, start=True)
    asker = hivemind.DHT(initial_peers=address, host_maddrs=[LOCALHOST], nat_port_map=False, start=True)
    try:
        server_id, silent_id = str(server.peer_id), str(silent.peer_id)
        record = make_record(run_fields(learning_rate=0.002), "monitor", peer_id=server_id)
        signer = RSASignatureValidator(RSAPrivateKey()).local_public_key
        serve_config(server, RUN, record, signer)
        # a peer without the handler (an older version) is skipped; the next one in order answers
        initial = [f"/ip4/127.0.0.1/tcp/1/p2p/{silent_id}", *address]
        found = ask_initial_peers(asker, RUN, initial, timeout=3.0)
        assert found is not None and found[0] == server_id and found[1].fields() == record.fields()
        assert found[2] == signer  # the key that signs its records: its fingerprints are the address's own
        assert ask_initial_peers(asker, "other-run", address, timeout=3.0) is None
        serve_config(server, RUN, record.copy(update={"role": "leaving"}), b"not a key")  # a newer one
        assert ask_initial_peers(asker, RUN, address, timeout=3.0)[2] == b""  # a malformed signer: none
        assert ask_initial_peers(asker, RUN, address, timeout=3.0)[1].role == "leaving"
    finally:
        for dht in (asker, silent, server):
            dht.shutdown()
