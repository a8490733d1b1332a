"""Private swarms: access tokens, their checks, and a live private swarm on 127.0.0.1.

The fast tests cover tokens, the CLI, revocation lists and hivemind's signed-request protocol in one process.
The live tests share one private swarm (a monitor holding the authority key and two trainers with tokens) and
check that it trains, that peers without a valid token (none, expired, altered, foreign, revoked) are refused
with one line, that averaging, matchmaking and download requests need a token too, that replayed requests are
refused, and that revoking a running trainer's token stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    monitor_address,
    monitor_args,
    read_rows,
    saw_peers,
    trainer_args,
    trainer_rows,
    wait_until,
)
from cotrain.access import NO_TOKEN, Authority, PrivateKey, check_token, read_token_file, registry_path
from cotrain.cli import main
from cotrain.errors import UserError

RUN = "private-test"


def issue(tmp_path: Path, name: str, days: float = 30.0, key: str = "authority.key") -> Path:
    out = tmp_path / f"{name}.token"
    assert (
        main(
            [
                "token",
                "issue",
                "--name",
                name,
                "--valid-days",
                str(days),
                "--authority-key",
                str(tmp_path / key),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    return out


# --- fast -----------------------------------------------------------------------------------------


def test_issue_writes_a_private_token_that_verifies_and_lists(tmp_path, capsys):
    path = issue(tmp_path, "alice")
    assert (path.stat().st_mode & 0o777) == 0o600
    assert ((tmp_path / "authority.key").stat().st_mode & 0o777) == 0o600
    token = read_token_file(path)
    authority = Authority.load(tmp_path / "authority.key")
    assert token.name == "alice" and token.authority_public_key == authority.public_key_bytes
    assert check_token(token.proto(), authority.public_key) is None
    assert 29.9 * 86400 < token.expiration - time.time() <= 30 * 86400
    capsys.readouterr()
    assert main(["token", "list", "--json", "--authority-key", str(tmp_path / "authority.key")]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["name"], r["status"], r["fingerprint"]) for r in rows] == [
        ("alice", "valid", token.fingerprint)
    ]


def test_check_token_names_each_reason(tmp_path):
    authority = Authority.load(tmp_path / "a.key", create=True)
    other = Authority.load(tmp_path / "b.key", create=True)
    good = authority.mint("alice", PrivateKey(), time.time() + 3600)
    assert check_token(good.proto(), authority.public_key) is None
    assert check_token(None, authority.public_key) == NO_TOKEN
    altered = good.proto()
    altered.username = "mallory"
    assert "was not issued by this swarm's authority" in check_token(altered, authority.public_key)
    later = good.proto()
    later.expiration_time = str(int(time.time() + 10**6))
    assert "was not issued by this swarm's authority" in check_token(later, authority.public_key)
    foreign = other.mint("eve", PrivateKey(), time.time() + 3600)
    assert "was not issued by this swarm's authority" in check_token(foreign.proto(), authority.public_key)
    assert "was revoked" in check_token(good.proto(), authority.public_key, {good.fingerprint})
    old = authority.mint("old", PrivateKey(), time.time() - 5)
    assert "'old' expired at" in check_token(old.proto(), authority.public_key)


def test_bad_token_files_and_commands_are_one_line(tmp_path, capsys):
    path = issue(tmp_path, "alice")
    data = json.loads(path.read_text())
    data["name"] = "root"
    (tmp_path / "altered.token").write_text(json.dumps(data))
    with pytest.raises(UserError, match="not validly signed by its authority"):
        read_token_file(tmp_path / "altered.token")
    with pytest.raises(UserError, match="does not exist"):
        read_token_file(tmp_path / "nope.token")
    (tmp_path / "junk.token").write_text("{")
    with pytest.raises(UserError, match="is not a cotrain token"):
        read_token_file(tmp_path / "junk.token")
    capsys.readouterr()
    key = ["--authority-key", str(tmp_path / "authority.key")]
    assert main(["token", "revoke", "--name", "carol", *key]) == 2
    assert main(["token", "issue", "--name", "x y", *key]) == 2
    assert main(["token", "issue", "--name", "bob", "--valid-days", "-1", *key]) == 2
    assert main(["token", "list", "--authority-key", str(tmp_path / "missing.key")]) == 2
    assert (
        main(
            [
                "status",
                "--initial-peers",
                "/ip4/127.0.0.1/tcp/9/p2p/" + "1" * 46,
                "--access-token",
                str(tmp_path / "altered.token"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5 and all(
        line.startswith(("cotrain token: error:", "cotrain status: error:")) for line in err
    )
    assert "no token was issued to 'carol'" in err[0] and "authority key" in err[3], err
    assert "not validly signed" in err[4], err
    assert not (tmp_path / "bob.token").exists()


def test_revoke_marks_every_token_of_a_name(tmp_path, capsys):
    issue(tmp_path, "alice")
    second = read_token_file(issue(tmp_path, "alice"))
    issue(tmp_path, "bob")
    authority = Authority.load(tmp_path / "authority.key")
    assert (
        main(["token", "revoke", "--name", "alice", "--authority-key", str(tmp_path / "authority.key")]) == 0
    )
    assert (
        len(authority.revoked_fingerprints()) == 2 and second.fingerprint in authority.revoked_fingerprints()
    )
    assert (
        main(["token", "revoke", "--name", "alice", "--authority-key", str(tmp_path / "authority.key")]) == 0
    )
    assert "already revoked" in capsys.readouterr().out
    statuses = [
        e["name"] for e in json.loads(registry_path(tmp_path / "authority.key").read_text())["tokens"]
    ]
    assert statuses == ["alice", "alice", "bob"]


def test_revocation_lists_must_be_signed_by_the_authority_for_their_expiration(tmp_path):
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    from cotrain.access import AccessControl, RevocationsValidator

    issue(tmp_path, "alice")
    path = issue(tmp_path, "bob")
    authority = Authority.load(tmp_path / "authority.key")
    older = authority.signed_revocations(time.time() + 60)  # before bob's revocation
    authority.revoke("bob")
    peer = AccessControl.for_token(RUN, str(path.with_name("alice.token")))
    validator = RevocationsValidator(peer.revocations_key, authority.public_key_bytes)
    key = DHTID.generate(source=peer.revocations_key).to_bytes()
    value = authority.signed_revocations(time.time() + 60)

    def record(v, expiration=value["expires"], k=key):
        return DHTRecord(k, b"", MSGPackSerializer.dumps(v), expiration)

    assert validator.validate(record(value))
    assert not validator.validate(
        record(value, expiration=value["expires"] + 1000)
    )  # kept alive by a replayer
    assert not validator.validate(record({**value, "revoked": []}))  # revocations hidden
    assert validator.validate(record({"anything": 1}, k=DHTID.generate(source="other").to_bytes()))
    bob = read_token_file(path).proto()
    assert peer.refusal(bob) is None  # the peer has not read the list yet
    assert peer.accept_revocations(value) and "was revoked" in peer.refusal(bob)
    assert not peer.accept_revocations(older) and "was revoked" in peer.refusal(bob)  # older lists never win
    assert not peer.accept_revocations({**value, "revoked": []})


def test_dht_requests_are_signed_and_replays_refused(tmp_path):
    """hivemind's token protocol with cotrain's tokens: valid, replayed, altered, foreign and revoked."""
    from hivemind.proto import dht_pb2

    from cotrain.access import AccessControl, SwarmAuthorizer

    alice = AccessControl.for_token(RUN, str(issue(tmp_path, "alice")))
    carol = AccessControl.for_token(RUN, str(issue(tmp_path, "carol")))
    mallory = AccessControl.for_token(RUN, str(issue(tmp_path, "mallory", key="other.key")))
    server = AccessControl.for_authority(RUN, str(tmp_path / "authority.key"))

    async def scenario():
        service = SwarmAuthorizer(server)

        async def signed(access):
            request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(), validate=False)
            await SwarmAuthorizer(access).sign_request(request, None)
            return request

        request = await signed(alice)
        copy = dht_pb2.PingRequest.FromString(request.SerializeToString())
        assert await service.validate_request(request)
        assert not await service.validate_request(copy)  # the same nonce again
        altered = await signed(alice)
        altered.validate = True
        assert not await service.validate_request(altered)
        assert not await service.validate_request(await signed(mallory))
        unsigned = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo())
        assert not await service.validate_request(unsigned)
        request = await signed(carol)
        Authority.load(tmp_path / "authority.key").revoke("carol")
        assert not await service.validate_request(request)
        response = dht_pb2.PingResponse()
        probe = await signed(alice)
        await service.sign_response(response, probe)
        assert await SwarmAuthorizer(alice).validate_response(response, probe)

    asyncio.run(scenario())


def test_a_renewed_token_file_is_picked_up_without_a_restart(tmp_path, monkeypatch):
    from cotrain.access import control

    monkeypatch.setattr(control, "OWN_TOKEN_RECHECK", 0.0)
    path = issue(tmp_path, "alice", days=1)
    access = control.AccessControl.for_token(RUN, str(path))
    first = access.own()
    time.sleep(1.1)  # a new modification time
    issue(tmp_path, "alice", days=60)
    renewed = access.own()
    assert renewed.proto != first.proto and renewed.expiration > first.expiration + 50 * 86400


def test_a_token_that_expires_mid_run_is_refused_from_then_on(tmp_path):
    from cotrain.access import AccessControl

    authority = Authority.load(tmp_path / "authority.key", create=True)
    path = tmp_path / "short.token"
    path.write_bytes(authority.mint("short", PrivateKey(), time.time() + 3).to_json())
    access = AccessControl.for_token(RUN, str(path))
    server = AccessControl.for_authority(RUN, str(tmp_path / "authority.key"))
    assert access.own_refusal() is None and server.refusal(access.own().proto) is None  # checked, remembered
    time.sleep(max(0.0, access.own().expiration - time.time()) + 0.5)
    assert "access token 'short' expired at" in access.own_refusal()
    assert "expired at" in server.refusal(access.own().proto)


def test_monitor_and_peer_options_exclude_each_other(tmp_path):
    from cotrain.access import access_for

    path = issue(tmp_path, "alice")
    with pytest.raises(UserError, match="not both"):
        access_for(RUN, str(path), str(tmp_path / "authority.key"))
    assert access_for(RUN, "", "") is None
    with pytest.raises(UserError, match="does not exist"):
        access_for(RUN, "", str(tmp_path / "missing.key"))


def test_the_access_package_stays_below_config_models_and_data():
    """`cotrain token` runs without hivemind; the access package imports no config, models, checkpoints or
    data (each checked in a fresh interpreter)."""
    import subprocess
    import sys

    token = (
        "import sys, tempfile; from cotrain.cli import main; d = tempfile.mkdtemp(); "
        "key, out = d + '/k', d + '/a.token'; "
        "assert main(['token', 'issue', '--name', 'a', '--authority-key', key, '-o', out]) == 0; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", token], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]", out
    layers = (
        "import sys, cotrain.access as a; [getattr(a, n) for n in a.__all__]; "
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in [['cotrain', n] for n in "
        "('config', 'models', 'checkpoints', 'data', 'roles', 'engine', 'api')]))"
    )
    out = subprocess.run([sys.executable, "-c", layers], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]", out


# --- a live private swarm -------------------------------------------------------------------------


def metric_rows(path: Path) -> list[dict]:
    return [r for r in read_rows(path) if r.get("kind") != "eval" and "step" in r]


def swarm_step(swarm) -> int:
    return max((r["step"] for r in metric_rows(swarm["metrics"])), default=-1)


@pytest.fixture(scope="module")
def private_swarm(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("private")
    for name in ("alice", "carol", "dave"):
        issue(out, name)
    assert main(["token", "revoke", "--name", "dave", "--authority-key", str(out / "authority.key")]) == 0
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
    monitor_extra = ["--authority-key", str(out / "authority.key"), "--dataset-path", str(demo_data)]
    monitor_extra += ["--save-every", "2"]
    roles = {"monitor": Role(monitor_args(common, out / "monitor", *monitor_extra), out / "monitor.log")}
    try:
        initial = monitor_address(out / "monitor", 180)
        for i, name in enumerate(("alice", "carol")):
            token = ["--access-token", str(out / f"{name}.token")]
            roles[name] = Role(
                trainer_args(common, initial, demo_data, i + 1, out / name, *token), out / f"{name}.log"
            )
        swarm = {
            "out": out,
            "roles": roles,
            "initial": initial,
            "common": common,
            "metrics": out / "monitor" / "metrics.jsonl",
            "data": demo_data,
        }

        def trained_together():
            return (
                swarm_step(swarm) >= 2
                and saw_peers(metric_rows(swarm["metrics"]), 2)
                and all(any(r["group_size"] == 2 for r in trainer_rows(roles[n])) for n in ("alice", "carol"))
            )

        wait_until(trained_together, 360, what="two trainers with tokens averaging in the private swarm")
        yield swarm
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_valid_tokens_train_together_and_the_monitor_checkpoints(private_swarm):
    rows = metric_rows(private_swarm["metrics"])
    assert max(r["step"] for r in rows) >= 2 and max(r["alive_peers"] for r in rows) >= 2, rows
    monitor = private_swarm["roles"]["monitor"].text()
    assert "--access-token TOKEN_FILE" in monitor  # the join command it prints
    wait_until(
        lambda: "Saved checkpoint" in private_swarm["roles"]["monitor"].text(),
        90,
        what="a checkpoint: the monitor downloaded the state from a trainer",
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_peers_without_a_valid_token_are_refused_with_one_line(private_swarm, tmp_path):
    out, initial, common = private_swarm["out"], private_swarm["initial"], private_swarm["common"]
    foreign = issue(tmp_path, "mallory", key="other.key")  # a token from another authority
    expired_key = Authority.load(out / "authority.key")
    expired = tmp_path / "expired.token"
    expired.write_bytes(expired_key.mint("erin", PrivateKey(), time.time() - 60).to_json())
    status = [
        "status",
        "--run-id",
        RUN,
        "--initial-peers",
        *initial,
        "--host-maddrs",
        LOCALHOST,
        "--startup-timeout",
        "30",
    ]
    cases = {
        "no token": (status, "cotrain status: error: " + NO_TOKEN),
        "foreign": ([*status, "--access-token", str(foreign)], "was not issued by this swarm's authority"),
        "revoked": ([*status, "--access-token", str(out / "dave.token")], "access token 'dave' was revoked"),
        "expired": ([*status, "--access-token", str(expired)], "access token 'erin' expired at"),
        "trainer without a token": (
            [
                "train",
                *common,
                "--initial-peers",
                *initial,
                "--dataset-path",
                str(private_swarm["data"]),
                "--output-dir",
                str(tmp_path / "t"),
            ],
            "cotrain train: error: " + NO_TOKEN,
        ),
    }
    roles = {what: Role(args, tmp_path / f"{i}.log") for i, (what, (args, _)) in enumerate(cases.items())}
    try:
        for what, role in roles.items():
            role.proc.wait(timeout=150)
            lines = role.text().strip().splitlines()
            assert role.proc.returncode == 2, (what, lines)
            assert cases[what][1] in lines[-1], (what, lines)
            assert "Traceback" not in role.text(), (what, role.text())
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()
    assert "Refused a DHT request" in private_swarm["roles"]["monitor"].text()


def trainer_address(role: Role) -> tuple[str, str]:
    text = role.text()
    peer_id = re.search(r"Trainer (\w+) joined", text).group(1)
    maddr = re.search(rf"(/ip4/127\.0\.0\.1/tcp/\d+)/p2p/{peer_id}", text).group(1)
    return peer_id, maddr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_averaging_download_and_dht_requests_need_a_token_and_replays_fail(private_swarm):
    from hivemind.p2p import P2P, P2PHandlerError, PeerID
    from hivemind.proto import averaging_pb2, dht_pb2
    from hivemind.utils.multiaddr import Multiaddr

    from cotrain.access import AccessControl, GuardedP2P, SwarmAuthorizer
    from cotrain.access.guard import handshake_payload as payload
    from cotrain.access.wire import HANDSHAKE, messages
    from cotrain.swarm.keys import state_averager_prefix

    out = private_swarm["out"]
    monitor_addr = private_swarm["initial"][0]
    monitor = PeerID.from_base58(monitor_addr.split("/p2p/")[1])
    trainer_id, trainer_maddr = trainer_address(private_swarm["roles"]["alice"])
    trainer = PeerID.from_base58(trainer_id)
    alice = AccessControl.for_token(RUN, str(out / "alice.token"))
    namespace = state_averager_prefix(RUN)
    options = dict(host_maddrs=[LOCALHOST], nat_port_map=False, auto_nat=False, use_relay=False)
    m = messages()

    async def download(p2p) -> list:
        from hivemind.optim.state_averager import TrainingStateAverager

        stub = TrainingStateAverager.get_stub(p2p, trainer, namespace=namespace)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        return [message async for message in stream]

    async def join_group(p2p) -> list:
        from hivemind.optim.state_averager import TrainingStateAverager

        stub = TrainingStateAverager.get_stub(p2p, trainer, namespace=namespace)
        stream = await stub.rpc_join_group(
            averaging_pb2.JoinRequest(schema_hash=b"x", expiration=time.time() + 5)
        )
        return [message async for message in stream]

    async def scenario():
        outsider = await P2P.create(**options)
        member = (await GuardedP2P.create(**options)).setup_guard(alice)
        try:
            for p2p in (outsider, member):
                await p2p._client.connect(monitor, [Multiaddr(monitor_addr.split("/p2p/")[0])])
                await p2p._client.connect(trainer, [Multiaddr(trainer_maddr)])
            # averaging, matchmaking and state download refuse a peer without a token ...
            for call in (download, join_group):
                with pytest.raises(Exception, match="access refused"):
                    await call(outsider)
            # ... and serve one that proves a token
            state = await download(member)
            assert state and state[0].metadata, "a peer with a token downloads the model"
            # a handshake replayed (by someone who saw it) is refused, as is a token shown without its key
            own = alice.own()
            request = m.AccessRequest(token=own.proto.SerializeToString(), time=time.time(), nonce=b"n" * 16)
            request.signature = own.key.sign(
                payload(b"request", namespace, outsider.peer_id, trainer, request.time, request.nonce)
            )
            handle = f"{namespace}::{HANDSHAKE}"
            first = await outsider.call_protobuf_handler(trainer, handle, request, m.AccessReply)
            again = await outsider.call_protobuf_handler(trainer, handle, request, m.AccessReply)
            assert first.granted and not again.granted and "replayed" in again.reason, (first, again)
            stolen = m.AccessRequest(token=own.proto.SerializeToString(), time=time.time(), nonce=b"s" * 16)
            stolen.signature = PrivateKey().sign(
                payload(b"request", namespace, outsider.peer_id, trainer, stolen.time, stolen.nonce)
            )
            reply = await outsider.call_protobuf_handler(trainer, handle, stolen, m.AccessReply)
            assert not reply.granted and "not signed by the key of the token" in reply.reason
            # DHT: a signed request is served once; the same bytes again, or no signature, are refused
            ping = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(), validate=False)
            await SwarmAuthorizer(alice).sign_request(ping, None)
            answer = await outsider.call_protobuf_handler(
                monitor, "DHTProtocol.rpc_ping", ping, dht_pb2.PingResponse
            )
            assert answer.auth.service_access_token.username == "authority"
            with pytest.raises(P2PHandlerError):
                await outsider.call_protobuf_handler(
                    monitor, "DHTProtocol.rpc_ping", ping, dht_pb2.PingResponse
                )
            with pytest.raises(P2PHandlerError):
                await outsider.call_protobuf_handler(
                    monitor,
                    "DHTProtocol.rpc_ping",
                    dht_pb2.PingRequest(peer=dht_pb2.NodeInfo()),
                    dht_pb2.PingResponse,
                )
        finally:
            await outsider.shutdown()
            await member.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_revoking_a_running_trainer_stops_it_and_the_swarm_goes_on(private_swarm):
    roles = private_swarm["roles"]
    carol = roles["carol"]
    assert (
        main(
            [
                "token",
                "revoke",
                "--name",
                "carol",
                "--authority-key",
                str(private_swarm["out"] / "authority.key"),
            ]
        )
        == 0
    )
    revoked_at = time.monotonic()
    carol.proc.wait(timeout=120)
    lines = carol.text().strip().splitlines()
    assert carol.proc.returncode == 2, lines[-5:]
    assert lines[-1] == (
        "cotrain train: error: the swarm refused this peer: access token 'carol' was revoked by the swarm's "
        "operator"
    ), lines[-5:]
    stopped_after = time.monotonic() - revoked_at
    step = swarm_step(private_swarm)
    wait_until(lambda: swarm_step(private_swarm) > step, 120, what="alice training on after carol left")
    assert roles["alice"].proc.poll() is None and roles["monitor"].proc.poll() is None
    print(f"revoked trainer stopped {stopped_after:.1f} s after `cotrain token revoke`")
