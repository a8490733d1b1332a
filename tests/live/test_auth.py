"""Private swarms.

Here, with cotrain processes; the rest in tests/swarm/test_auth.py and tests/unit/access/test_auth.py."""

from __future__ import annotations

import asyncio
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
from cotrain.access import NO_TOKEN, Authority, PrivateKey
from cotrain.cli import main
from support.auth import RUN, issue


def test_the_access_package_stays_below_config_models_and_data():
    """`cotrain token` runs without hivemind; the access package imports no config, models, checkpoints,
    data, net or hivemind_ext (each checked in a fresh interpreter: every module of the package imported)."""
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
        "import sys, pkgutil, importlib, cotrain.access as a; [getattr(a, n) for n in a.__all__]; "
        "[importlib.import_module(f'cotrain.access.{m.name}') for m in pkgutil.iter_modules(a.__path__)]; "
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in [['cotrain', n] for n in "
        "('config', 'models', 'checkpoints', 'data', 'roles', 'engine', 'api', 'net', 'hivemind_ext')]))"
    )
    out = subprocess.run([sys.executable, "-c", layers], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]", out


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
@pytest.mark.timeout(240)
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
@pytest.mark.timeout(240)
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
@pytest.mark.timeout(240)
def test_averaging_download_and_dht_requests_need_a_token_and_replays_fail(private_swarm):
    from hivemind.p2p import P2P, P2PHandlerError, PeerID
    from hivemind.proto import averaging_pb2, dht_pb2
    from hivemind.utils.multiaddr import Multiaddr

    from cotrain.access import AccessControl
    from cotrain.access.tokens import MALFORMED
    from cotrain.access.wire import CHECK_HANDLE, HANDSHAKE, messages
    from cotrain.hivemind_ext.authorizer import SwarmAuthorizer
    from cotrain.hivemind_ext.guard import GuardedP2P
    from cotrain.hivemind_ext.guard import handshake_payload as payload
    from cotrain.keys import state_averager_prefix

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
            # averaging, matchmaking and state download refuse a peer without a token: the guard's error, or
            # on a loaded machine a stream that ends before the error reaches the caller; nothing is served
            # (an unguarded handler answers both calls with a message: the state, a bad-schema reply)
            for call in (download, join_group):
                try:
                    served = await call(outsider)
                except Exception as e:
                    assert "access refused" in str(e), e
                else:
                    assert served == [], served
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
            # dave's revoked token with its signature re-encoded (a newline added: the same signature to a
            # lenient base64 decoder) is refused by the DHT, the access check and the averagers alike
            dave = AccessControl.for_token(RUN, str(out / "dave.token"))
            dave.own().proto.signature += b"\n"
            ping = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(), validate=False)
            await SwarmAuthorizer(dave).sign_request(ping, None)
            assert ping.auth.client_access_token.signature.endswith(b"\n")
            with pytest.raises(P2PHandlerError):
                await outsider.call_protobuf_handler(
                    monitor, "DHTProtocol.rpc_ping", ping, dht_pb2.PingResponse
                )
            check = m.AccessRequest(token=dave.own().proto.SerializeToString())
            reply = await outsider.call_protobuf_handler(monitor, CHECK_HANDLE, check, m.AccessReply)
            assert not reply.granted and reply.reason == MALFORMED, reply
            respelled = (await GuardedP2P.create(**options)).setup_guard(dave)
            try:
                await respelled._client.connect(trainer, [Multiaddr(trainer_maddr)])
                with pytest.raises(Exception, match="malformed"):
                    await download(respelled)
            finally:
                await respelled.shutdown()
        finally:
            await outsider.shutdown()
            await member.shutdown()

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.timeout(240)
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
    refusal = "the swarm refused this peer: access token 'carol' was revoked by the swarm's operator"
    assert lines[-1] == f"cotrain train: error: {refusal}", lines[-5:]
    assert sum(refusal in line for line in lines) == 1, lines[-5:]  # said once, as its error line
    # the monitor counts the revoked tokens it publishes as `token revoke` does: dave's, then carol's too
    monitor = roles["monitor"]
    published = "Published the revocation list: "
    wait_until(lambda: f"{published}2 revoked tokens" in monitor.text(), 30, what="the list with carol's")
    assert f"{published}1 revoked token\n" in monitor.text()
    stopped_after = time.monotonic() - revoked_at
    step = swarm_step(private_swarm)
    wait_until(lambda: swarm_step(private_swarm) > step, 120, what="alice training on after carol left")
    assert roles["alice"].proc.poll() is None and roles["monitor"].proc.poll() is None
    print(f"revoked trainer stopped {stopped_after:.1f} s after `cotrain token revoke`")
