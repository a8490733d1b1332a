"""The address is the trust anchor: a peer given only `--run-id` and `--initial-peers` takes the settings of
the initial peer it names (asked over libp2p, cotrain.net.vouch), not those that most DHT records publish
(any process can make keys and publish records)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from types import SimpleNamespace

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from conftest import FAST, LOCALHOST, Role, monitor_address, monitor_args, trainer_args, wait_until
from cotrain.config import RunConfig
from cotrain.engine.join import take_swarm_run
from cotrain.net.configrecord import ConfigPublisher, make_record, read_configs, schema_validators
from cotrain.net.vouch import (
    MAX_ANSWER,
    SeenNonces,
    _answer,
    ask_initial_peers,
    messages,
    parse_answer,
    request_payload,
    serve_config,
    signed_request,
)

PEER = "12D3KooWJ7mZQEzN7b4Yq1Mk8s3x5Z1pQ2a3b4c5d6e7f8g9h1j2"
RUN = "anchor-test"


def run_fields(**changes) -> dict:
    return dataclasses.asdict(dataclasses.replace(RunConfig(run_id=RUN), **changes))


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


# --- live: a monitor, three sybil keys and a newcomer given only the monitor's address -------------------

SYBIL_LR = 0.0123


def publish_sybils(address: list[str], run_id: str, n: int = 3) -> list[hivemind.DHT]:
    """``n`` DHT peers, each with an RSA key of its own, publishing the monitor's config with another
    learning rate under the run's config key: more records than the monitor's."""
    dhts: list[hivemind.DHT] = []
    for _ in range(n):
        signer = RSASignatureValidator(RSAPrivateKey())
        dht = hivemind.DHT(
            initial_peers=address,
            host_maddrs=[LOCALHOST],
            record_validators=[*schema_validators(run_id), signer],
            nat_port_map=False,
            start=True,
        )
        dhts.append(dht)
        monitors = wait_until(lambda d=dht: read_configs(d, run_id), 20, what="the monitor's config record")
        fields = {**next(iter(monitors.values())).fields(), "learning_rate": SYBIL_LR}
        record = make_record(fields, "trainer", peer_id=str(dht.peer_id))
        ConfigPublisher(dht, run_id, signer.local_public_key, record).publish()
    wait_until(lambda: len(read_configs(dhts[0], run_id)) >= n + 1, 20, what="the sybils' records")
    return dhts


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_newcomer_takes_the_settings_of_the_address_it_was_given_not_of_the_most_keys(demo_data, tmp_path):
    run_id = "anchor-live"
    common = ["--preset", "albert-tiny", "--run-id", run_id, "--host-maddrs", LOCALHOST, *FAST]
    monitor = Role(monitor_args(common, tmp_path / "monitor"), tmp_path / "monitor.log")
    roles, sybils = [monitor], []
    try:
        address = monitor_address(tmp_path / "monitor", 90)
        sybils = publish_sybils(address, run_id)
        newcomer_args = trainer_args(
            ["--run-id", run_id, "--host-maddrs", LOCALHOST, *FAST], address, demo_data, 1, tmp_path / "new"
        )
        newcomer = Role(newcomer_args, tmp_path / "new.log")
        roles.append(newcomer)
        wait_until(
            lambda: "Taking the settings of run" in newcomer.text(),
            60,
            what="the newcomer taking the run's settings",
        )
        text = newcomer.text()
        monitor_id = address[0].split("/p2p/")[-1]
        assert (
            f"Taking the settings of run {run_id!r} from initial peer {monitor_id}: preset albert-tiny"
            in text
        )
        # the peer wrote its config.toml at its start and writes it again with the settings it took
        written = tmp_path / "new" / "config.toml"
        wait_until(lambda: 'preset = "albert-tiny"' in _read(written), 30, what="the taken config")
        config = _read(written)
        assert str(SYBIL_LR) not in config, config
        # its config is then checked against the DHT's majority (the sybils' records), which refuses it: many
        # keys can still keep a newcomer out, not make it train with their settings
    finally:
        for dht in sybils:
            dht.shutdown()
        for role in roles:
            role.stop()


def _read(path) -> str:
    return path.read_text() if path.exists() else ""
