"""Private swarms.

Here, in the test process alone; the rest in tests/live/test_auth.py and tests/swarm/test_auth.py."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path

import pytest

from cotrain.access import NO_TOKEN, Authority, PrivateKey, check_token, read_token_file, registry_path
from cotrain.cli import main
from cotrain.errors import UserError
from support.auth import RUN, issue


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
    assert main(["token", "list", "--authority-key", str(tmp_path / "authority.key")]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["name", "fingerprint", "status", "expires"], header
    assert row.split()[:3] == ["alice", token.fingerprint, "valid"], row
    assert row.index(token.fingerprint) == header.index("fingerprint")  # the column under its heading


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
    key = ["--authority-key", str(tmp_path / "authority.key")]
    capsys.readouterr()
    assert main(["token", "revoke", "--name", "alice", *key]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "revoked 2 tokens of 'alice' (the revocation list now holds 2 revoked tokens); a running monitor "
        "tells the swarm within seconds"
    ]
    revoked = authority.revoked_fingerprints()  # both names of each of alice's two tokens
    assert len(revoked) == 4 and {second.fingerprint, second.signature_fingerprint} <= revoked
    assert len(authority.revoked_tokens()) == 2
    assert main(["token", "revoke", "--name", "bob", *key]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "revoked 1 token of 'bob' (the revocation list now holds 3 revoked tokens); a running monitor "
        "tells the swarm within seconds"
    ]
    assert main(["token", "revoke", "--name", "alice", *key]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "the tokens of 'alice' were already revoked (the revocation list holds 3 revoked tokens)"
    ]
    statuses = [
        e["name"] for e in json.loads(registry_path(tmp_path / "authority.key").read_text())["tokens"]
    ]
    assert statuses == ["alice", "alice", "bob"]


def test_revocation_lists_must_be_signed_by_the_authority_for_their_expiration(tmp_path):
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils.serializer import MSGPackSerializer

    from cotrain.access import AccessControl
    from cotrain.hivemind_ext.validators import RevocationsValidator

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

    from cotrain.access import AccessControl
    from cotrain.hivemind_ext.authorizer import SwarmAuthorizer

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


def token_as_sent(path: Path, signature: bytes | None = None):
    """The AccessToken a peer would send for the token file at ``path``, its signature spelled as given."""
    from hivemind.proto.auth_pb2 import AccessToken

    data = json.loads(path.read_text())
    return AccessToken(
        username=data["name"],
        public_key=data["public_key"].encode(),
        expiration_time=data["expiration_time"],
        signature=data["signature"].encode() if signature is None else signature,
    )


def respellings(signature: bytes) -> dict[str, bytes]:
    """The same signature in other base64 spellings that a lenient decoder reads as the same bytes."""
    raw = base64.b64decode(signature)
    return {
        "newline at the end": signature + b"\n",
        "line breaks every 76": base64.encodebytes(raw),
        "a space inside": signature[:10] + b" " + signature[10:],
        "junk padding": signature + b"==",
        "non-base64 junk": b"!" + signature + b"*",
    }


def test_a_revoked_token_stays_revoked_however_its_signature_is_spelled(tmp_path):
    """A token is named by what the authority signed, and its signature is read in one spelling only: a
    revoked token with a re-encoded signature is refused (as malformed), and so is a re-encoded valid one."""
    from cotrain.access import AccessControl, fingerprints
    from cotrain.access.tokens import MALFORMED

    alice, carol = issue(tmp_path, "alice"), issue(tmp_path, "carol")
    authority = Authority.load(tmp_path / "authority.key")
    authority.revoke("carol")
    revoked = authority.revoked_fingerprints()
    server = AccessControl.for_authority(RUN, str(tmp_path / "authority.key"))
    key = authority.public_key
    assert "'carol' was revoked" in check_token(token_as_sent(carol), key, revoked)
    assert check_token(token_as_sent(alice), key, revoked) is None
    for how, spelling in respellings(token_as_sent(carol).signature).items():
        token = token_as_sent(carol, spelling)
        assert read_token_file(carol).fingerprint in fingerprints(token), (
            how
        )  # the same name, whatever it says
        assert check_token(token, key, revoked) == MALFORMED, how
        assert server.refusal(token) == MALFORMED, how
        assert check_token(token_as_sent(alice, token_as_sent(alice).signature + b"\n"), key) == MALFORMED
        # the token file with that signature is refused in one line too
        data = json.loads(carol.read_text())
        data["signature"] = spelling.decode()
        (tmp_path / "respelled.token").write_text(json.dumps(data))
        with pytest.raises(UserError, match="respelled.token is damaged") as e:
            read_token_file(tmp_path / "respelled.token")
        assert "\n" not in str(e.value)
    # an RSA signature whose first byte is zero also verifies without it: that spelling is refused as well
    holder = PrivateKey()  # one key; each expiry signs a different message (generating keys is slow)
    for i in range(5000):
        short = authority.mint("zed", holder, time.time() + 3600 + i)
        raw = base64.b64decode(short.signature)
        if raw[0] == 0:
            break
    else:
        pytest.fail("no signature started with a zero byte")
    assert check_token(short.proto(), key) is None
    shortened = short.proto()
    shortened.signature = base64.b64encode(raw[1:])
    assert check_token(shortened, key) == MALFORMED


def test_a_registry_of_format_1_keeps_its_revoked_tokens_revoked(tmp_path, caplog, capsys):
    """Registries written before content fingerprints named tokens by a hash of the signature's text: read
    as format 2, their revoked tokens stay revoked under that name (said once in a log line), and the next
    change writes format 2."""
    import logging

    from cotrain.access.tokens import signature_fingerprint

    issue(tmp_path, "alice")
    carol = read_token_file(issue(tmp_path, "carol"))
    path = registry_path(tmp_path / "authority.key")
    entries = json.loads(path.read_text())["tokens"]
    old = [
        {
            "name": e["name"],
            "fingerprint": e["signature_fingerprint"],
            "issued": e["issued"],
            "expires": e["expires"],
            "revoked": time.time() if e["name"] == "carol" else None,
        }
        for e in entries
    ]
    path.write_text(json.dumps({"format": "cotrain-token-registry/1", "tokens": old}))
    authority = Authority.load(tmp_path / "authority.key")
    with caplog.at_level(logging.WARNING, logger="cotrain.access.authority"):
        revoked = authority.revoked_fingerprints()
        authority.revoked_fingerprints()
    assert revoked == {signature_fingerprint(carol.signature)}
    assert caplog.text.count("registered in format 1") == 1, caplog.text  # once, however often it is read
    assert "tokens of carol stay revoked by their signature's fingerprint" in caplog.text, caplog.text
    assert "was revoked" in check_token(carol.proto(), authority.public_key, revoked)
    assert check_token(token_as_sent(tmp_path / "alice.token"), authority.public_key, revoked) is None
    capsys.readouterr()
    assert main(["token", "list", "--authority-key", str(tmp_path / "authority.key")]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"carol\s+{signature_fingerprint(carol.signature)}\s+revoked", table), table
    issue(tmp_path, "bob")  # the next change writes format 2, carol still revoked
    assert json.loads(path.read_text())["format"] == "cotrain-token-registry/2"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cotrain.access.authority"):
        assert Authority.load(tmp_path / "authority.key").revoked_fingerprints() == revoked
    assert "tokens of carol stay revoked" in caplog.text  # said again by each process that reads it


@pytest.mark.parametrize(
    "change,problem",
    [
        (lambda d: d.update(extra="x"), "extra: extra inputs are not permitted"),
        (lambda d: d.pop("private_key"), "private_key: field required"),
        (lambda d: d.update(name="a" * 65), "name: value error, must be 1-64 letters"),
        (lambda d: d.update(name="alice\n"), "name: value error, must be 1-64 letters"),
        (lambda d: d.update(name=7), "name: input should be a valid string"),
        (lambda d: d.update(public_key="A" * 5000), "public_key: string should have at most"),
        (lambda d: d.update(signature="A" * 5000), "signature: string should have at most"),
        (lambda d: d.update(expiration_time="1e10"), "expiration_time: value error, must be whole seconds"),
        (lambda d: d.update(private_key="x" * 70000), "over 65536 bytes"),
    ],
    ids=[
        "extra",
        "missing",
        "long name",
        "final newline",
        "name type",
        "huge key",
        "huge signature",
        "expiry",
        "huge file",
    ],
)
def test_token_files_pass_a_strict_schema(tmp_path, change, problem):
    data = json.loads(issue(tmp_path, "alice").read_text())
    change(data)
    (tmp_path / "bad.token").write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        read_token_file(tmp_path / "bad.token")
    assert problem in str(e.value).lower() and "\n" not in str(e.value), str(e.value)


def test_registries_and_tokens_on_the_wire_pass_a_strict_schema(tmp_path, capsys):
    from cotrain.access.tokens import MALFORMED

    path = issue(tmp_path, "alice")
    registry = registry_path(tmp_path / "authority.key")
    good = json.loads(registry.read_text())
    key = ["--authority-key", str(tmp_path / "authority.key")]
    damaged = {  # the file itself: refused whole
        "not JSON": "{",
        "another format": json.dumps({**good, "format": "cotrain-token-registry/9"}),
        "tokens not a list": json.dumps({**good, "tokens": {"alice": good["tokens"][0]}}),
        "an extra field": json.dumps({**good, "admin": True}),
    }
    for what, text in damaged.items():
        registry.write_text(text)
        capsys.readouterr()
        assert main(["token", "list", *key]) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is damaged" in err[0], (what, err)
    registry.write_text(json.dumps(good))
    authority = Authority.load(tmp_path / "authority.key")
    for field, value in [
        ("username", "x" * 10_000),
        ("username", "alice\n"),
        ("expiration_time", "9" * 40),
        ("expiration_time", token_as_sent(path).expiration_time + "\n"),
        ("public_key", b"A" * 10_000),
    ]:
        token = token_as_sent(path)
        setattr(token, field, value)
        assert check_token(token, authority.public_key) == MALFORMED, field


def test_one_bad_registry_entry_is_skipped_and_the_others_still_list_and_revoke(tmp_path, capsys, caplog):
    """A registry entry that does not pass its schema (a name with a final newline, as `token issue` once
    accepted; a field of the wrong type) is skipped with a warning naming it; list and revoke go on with the
    others, the entry is kept, and one marked revoked keeps its fingerprints in the revocation list."""
    import logging

    key = ["--authority-key", str(tmp_path / "authority.key")]
    assert main(["token", "issue", "--name", "alice\n", "--output", str(tmp_path / "nl.token"), *key]) == 2
    assert "token name 'alice\\n'" in capsys.readouterr().err
    assert not (tmp_path / "nl.token").exists() and not list(tmp_path.glob("alice*"))
    alice, bob, carol = (read_token_file(issue(tmp_path, name)) for name in ("alice", "bob", "carol"))
    registry = registry_path(tmp_path / "authority.key")
    data = json.loads(registry.read_text())
    data["tokens"][0]["name"] = "alice\n"  # what `token issue --name $'alice\n'` used to record
    data["tokens"][1]["issued"] = "yesterday"
    data["tokens"][2]["revoked"] = "yes"  # revoked, in a shape the schema refuses: stays revoked
    data["tokens"].append(["not", "an", "entry"])
    registry.write_text(json.dumps(data))
    bad_entries = data["tokens"]
    issue(tmp_path, "dave")  # issuing goes on too
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cotrain.access.authority"):
        assert main(["token", "list", "--json", *key]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in rows] == ["dave"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4 and all("skipping entry" in w for w in warnings), warnings
    assert "entry 1 (name 'alice\\n')" in warnings[0] and "entry 2 (name 'bob')" in warnings[1]
    assert "entry 4," in warnings[3] and all("\n" not in w for w in warnings), warnings
    assert main(["token", "revoke", "--name", "dave", *key]) == 0
    assert main(["token", "revoke", "--name", "bob", *key]) == 0  # its entry is skipped, still revoked
    tokens = json.loads(registry.read_text())["tokens"]
    assert [t["name"] if isinstance(t, dict) else t for t in tokens] == [
        "alice\n",
        "bob",
        "carol",
        ["not", "an", "entry"],
        "dave",
    ]  # the skipped entries are kept as they were, in their place; bob's now marked revoked
    assert tokens[1] == {**bad_entries[1], "revoked": tokens[1]["revoked"]} and tokens[1]["revoked"] > 0
    assert tokens[0] == bad_entries[0] and tokens[2:4] == bad_entries[2:] and tokens[4]["revoked"] > 0
    revoked = Authority.load(tmp_path / "authority.key").revoked_fingerprints()
    assert {bob.fingerprint, carol.fingerprint, carol.signature_fingerprint} <= revoked
    assert alice.fingerprint not in revoked  # never revoked: its name alone is out of shape


def test_secret_files_open_to_other_users_are_used_with_one_warning(tmp_path, caplog):
    """A token file or an authority key that its group or others may read is used, with one warning line
    naming it and the chmod to run; the files cotrain writes are its owner's only, whatever the umask."""
    import logging
    import os

    old = os.umask(0)
    try:
        token_path = issue(tmp_path, "alice")
    finally:
        os.umask(old)
    key_path = tmp_path / "authority.key"
    for path in (token_path, key_path, registry_path(key_path)):
        assert (path.stat().st_mode & 0o777) == 0o600, path

    def warnings(read) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            read()
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    for path, what, read in [
        (token_path, "access token file", lambda: read_token_file(token_path)),
        (key_path, "authority key", lambda: Authority.load(key_path)),
        (key_path, "authority key", lambda: main(["token", "list", "--authority-key", str(key_path)])),
    ]:
        assert warnings(read) == [], path
        path.chmod(0o644)
        said = warnings(read)
        assert len(said) == 1 and said[0].startswith(f"The {what} {path} is open to other users"), said
        assert said[0].endswith(f"run `chmod 600 {path}`"), said
        path.chmod(0o600)


def test_private_files_are_written_through_a_new_temp_file(tmp_path):
    """A symlink or file planted at the temp name that writes used to take is neither followed nor used."""
    import os

    from cotrain.privatefile import write_private

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    target = tmp_path / "authority.key"
    planted = tmp_path / f".{target.name}.tmp{os.getpid()}"
    planted.symlink_to(victim)
    Authority.load(target, create=True)  # writes the key with write_private
    assert victim.read_text() == "keep me" and planted.is_symlink()
    assert not target.is_symlink() and b"PRIVATE KEY" in target.read_bytes()
    assert (target.stat().st_mode & 0o777) == 0o600
    registry = registry_path(target)
    (tmp_path / f".{registry.name}.tmp{os.getpid()}").symlink_to(victim)
    issue(tmp_path, "alice")
    assert victim.read_text() == "keep me" and not registry.is_symlink() and "alice" in registry.read_text()
    write_private(tmp_path / "again.txt", b"secret")
    assert (tmp_path / "again.txt").read_bytes() == b"secret"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temp file left


def test_only_a_refusal_the_peer_can_verify_stops_it(tmp_path):
    """An initial peer's answer to the access check is not signed: it stops the asking peer only when the
    peer can check it (a revocation list signed by the authority naming its token, its own check, or, before
    it joined, a claim nothing it knows contradicts)."""
    from cotrain.access import AccessControl
    from cotrain.access.tokens import MALFORMED
    from cotrain.access.wire import messages
    from cotrain.hivemind_ext.authorizer import _answer_check
    from cotrain.net.probe import Verdict, judge

    m = messages()
    carol = AccessControl.for_token(RUN, str(issue(tmp_path, "carol")))
    alice = AccessControl.for_token(RUN, str(issue(tmp_path, "alice")))
    Authority.load(tmp_path / "authority.key").revoke("carol")
    monitor = AccessControl.for_authority(RUN, str(tmp_path / "authority.key"))
    revoked = "access token 'carol' was revoked by the swarm's operator"

    def refused(reason: str, revocations: bytes = b""):
        return m.AccessReply(granted=False, reason=reason, revocations=revocations)

    def answer(access: AccessControl):
        request = m.AccessRequest(token=access.own().proto.SerializeToString())
        return asyncio.run(_answer_check(monitor, request, None))

    # an unsigned claim, from whichever initial peer, stops nobody
    assert judge(refused(revoked), carol, joined=True) == Verdict(
        unverified=revoked + (" (without a revocation list signed by the authority naming it)")
    )
    assert judge(refused(revoked), carol, joined=False).stop is None
    for claim in (MALFORMED, "access token 'carol' expired at 2020-01-01 00:00:00 UTC", NO_TOKEN):
        assert judge(refused(claim), carol, joined=False) == Verdict(unverified=claim)
    foreign = "access token 'carol' was not issued by this swarm's authority (or was altered)"
    assert judge(refused(foreign), carol, joined=True).stop is None  # the swarm accepted it when it joined
    assert judge(refused(foreign), carol, joined=False) == Verdict(stop=foreign)
    assert judge(m.AccessReply(granted=True), carol, joined=True) == Verdict()
    # a revocation list not signed by the authority proves nothing
    other = Authority.load(tmp_path / "other.key", create=True)
    from hivemind.utils.serializer import MSGPackSerializer

    forged = other.signed_revocations(time.time() + 60)
    forged["revoked"] = sorted(monitor.revoked)
    assert judge(refused(revoked, MSGPackSerializer.dumps(forged)), carol, joined=True).stop is None
    # the monitor's answer carries the list it published, signed: that stops carol, not alice
    assert answer(carol).revocations == b""  # nothing published yet: no proof
    monitor.revocations_record = monitor.authority.signed_revocations(time.time() + 60)
    reply = answer(carol)
    assert not reply.granted and reply.revocations
    assert judge(reply, carol, joined=True) == Verdict(stop=revoked)
    assert carol.own_refusal() == revoked  # its own check agrees from now on
    assert (
        answer(alice).granted and judge(refused(revoked, reply.revocations), alice, joined=True).stop is None
    )
    # a peer without a token stops on any refusal; control characters never reach a log
    assert judge(refused("x"), None, joined=False) == Verdict(stop=NO_TOKEN)
    assert judge(refused("a\x1b[2Jb\nc"), alice, joined=False) == Verdict(unverified="a?[2Jb?c")


def test_an_access_control_leaves_its_lock_behind_when_its_state_is_taken(tmp_path):
    from cotrain.access.control import AccessControl

    control = AccessControl.for_token(RUN, str(issue(tmp_path, "alice")))
    state = control.__getstate__()  # what pickling it sends
    assert not any(isinstance(v, type(control._state_lock)) for v in state.values())
    copy = AccessControl.__new__(AccessControl)
    copy.__setstate__(state)
    assert copy._state_lock is not control._state_lock and copy._state_lock.acquire(blocking=False)
