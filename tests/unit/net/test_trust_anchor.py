"""The address is the trust anchor.

Here, in the test process alone; the rest in tests/live/test_trust_anchor.py and
tests/swarm/test_trust_anchor.py."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

from cotrain.config import RunConfig
from cotrain.engine.join import take_swarm_run
from cotrain.net.configrecord import make_record
from cotrain.net.vouch import (
    MAX_ANSWER,
    SeenNonces,
    _answer,
    messages,
    parse_answer,
    request_payload,
    signed_request,
)
from support.trust_anchor import RUN, run_fields

PEER = "12D3KooWJ7mZQEzN7b4Yq1Mk8s3x5Z1pQ2a3b4c5d6e7f8g9h1j2"


def answer(fields: dict, peer: str = PEER) -> bytes:
    return make_record(fields, "monitor", peer_id=peer).json().encode()


def test_an_answer_counts_only_when_it_is_the_asked_peers_valid_record_of_this_run():
    good = parse_answer(answer(run_fields()), PEER, RUN)
    assert good is not None and good.fields() == run_fields()
    assert parse_answer(b"", PEER, RUN) is None  # not of this run, or refused
    assert parse_answer(answer(run_fields(), peer="12D3KooWother"), PEER, RUN) is None  # speaks for another
    assert parse_answer(answer(run_fields(run_id="other-run")), PEER, RUN) is None
    forged = json.loads(answer(run_fields()))
    forged["config"] = forged["config"].replace('"learning_rate"', '"learning_rate" ')
    assert parse_answer(json.dumps(forged).encode(), PEER, RUN) is None  # its hash does not match
    assert parse_answer(b"{not json", PEER, RUN) is None
    padded = b" " * MAX_ANSWER + answer(run_fields())  # valid JSON, but over the cap: not even parsed
    assert json.loads(padded) and parse_answer(padded, PEER, RUN) is None


class FakeConnection:
    def __init__(self, vouched, majority):
        self.vouched, self.majority = vouched, majority

    def initial_peer_run(self):
        return self.vouched

    def swarm_run(self):
        return self.majority


def test_the_initial_peers_answer_wins_over_a_dht_majority(caplog):
    own, sybils = run_fields(learning_rate=0.001), run_fields(learning_rate=0.5, init_from="/evil")
    caplog.set_level(logging.INFO, logger="cotrain.engine.join")
    taken = take_swarm_run(FakeConnection((PEER, own), (sybils, 3)), RunConfig(run_id=RUN))
    assert taken.learning_rate == 0.001 and taken.init_from == ""
    assert f"Taking the settings of run {RUN!r} from initial peer {PEER}: preset" in caplog.text
    assert "no address vouches" not in caplog.text


def test_without_an_answering_initial_peer_the_dht_majority_is_taken_and_said_unvouched(caplog):
    sybils = run_fields(learning_rate=0.5)
    caplog.set_level(logging.INFO, logger="cotrain.engine.join")
    taken = take_swarm_run(FakeConnection(None, (sybils, 3)), RunConfig(run_id=RUN))
    assert taken.learning_rate == 0.5
    assert f"Taking the settings of run {RUN!r} from the swarm (3 peers)" in caplog.text
    assert any(
        r.levelno == logging.WARNING and "no address vouches" in r.getMessage() for r in caplog.records
    )
    alone = take_swarm_run(FakeConnection(None, None), RunConfig(run_id=RUN, preset="gpt2-tiny"))
    assert alone.preset == "gpt2-tiny"


def test_a_private_swarm_answers_only_a_request_with_an_accepted_token():
    from hivemind.proto.auth_pb2 import AccessToken

    m = messages()
    served = {RUN: (answer(run_fields()), b"")}
    token = AccessToken(username="alice").SerializeToString()
    refusing = SimpleNamespace(refusal=lambda token: "no access token" if token is None else "revoked")

    def ask(access, **request):
        return asyncio.run(
            _answer(served, access, m.ConfigRequest(**request), None, seen=SeenNonces())
        ).record

    assert ask(None, run_id=RUN) == served[RUN][0]  # a public swarm
    assert ask(None, run_id="other-run") == b""
    assert ask(refusing, run_id=RUN, token=token) == b""
    assert ask(refusing, run_id=RUN) == b""
    assert ask(refusing, run_id=RUN, token=b"\xff garbage") == b""


def test_a_private_swarm_answers_only_a_request_that_proves_its_token_key_for_this_peer_now():
    """A bare token (voter records and every DHT request carry one) is refused: the request must be signed by
    the token's key, over both peer ids, the time and a fresh nonce."""
    from hivemind.p2p import PeerID
    from hivemind.proto.auth_pb2 import AccessToken

    from cotrain.access.crypto import PrivateKey

    m = messages()
    served = {RUN: (answer(run_fields()), b"")}
    alice, mallory = PrivateKey(), PrivateKey()
    token = AccessToken(username="alice", public_key=alice.get_public_key().to_bytes(), expiration_time="9")
    own = SimpleNamespace(proto=token, key=alice)
    # the token itself is accepted (its authority's signature is the access control's check: test_auth.py)
    access = SimpleNamespace(
        run_id=RUN, refusal=lambda token: None if token is not None else "no access token", own=lambda: own
    )
    asker, asked, other = (PeerID(bytes([0x12, 0x20, i] + [7] * 32)) for i in (1, 2, 3))
    seen = SeenNonces()

    def reply(request, sender=asker) -> bytes:
        context = SimpleNamespace(remote_id=sender, local_id=asked)
        return asyncio.run(_answer(served, access, request, context, seen=seen)).record

    assert reply(m.ConfigRequest(run_id=RUN, token=token.SerializeToString())) == b""  # a bare token
    with_proof = signed_request(access, RUN, asker, asked)
    assert with_proof.signature and len(with_proof.nonce) == 16
    assert reply(with_proof) == served[RUN][0]
    assert reply(with_proof) == b""  # replayed: its nonce was seen
    assert reply(signed_request(access, RUN, asker, other)) == b""  # made for another peer
    assert reply(signed_request(access, RUN, asker, asked), sender=other) == b""  # sent by another peer id
    late = signed_request(access, RUN, asker, asked)
    late.time -= 120
    late.signature = alice.sign(request_payload(RUN, asker, asked, late.time, late.nonce))
    assert reply(late) == b""  # signed, but over 60 s old
    own.key = mallory  # signed by a key other than the one the token names
    assert reply(signed_request(access, RUN, asker, asked)) == b""
    own.key = alice
    assert reply(signed_request(access, RUN, asker, asked)) == served[RUN][0]
