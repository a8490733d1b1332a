"""Per-peer network settings.

Here, with cotrain processes; the rest in tests/unit/net/test_peers.py."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys

import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    cotrain_env,
    events,
    monitor_address,
    monitor_args,
    read_rows,
    trainer_args,
    trainer_rows,
    wait_until,
)
from cotrain.net.identity import ensure_identity

RUN = "peers-test"


def run_cotrain(*args: str, timeout: float = 300) -> tuple[int | None, str]:
    """Exit code (None: still running after ``timeout`` s, then stopped) and output of a `cotrain` command."""
    p = subprocess.Popen(
        [sys.executable, "-m", "cotrain", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cotrain_env(),
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)  # the supervisor stops its worker in order
        out, _ = p.communicate(timeout=30)
        return None, out


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.timeout(60)
def test_a_corrupt_identity_stops_a_trainer_with_one_line(tmp_path):
    path = tmp_path / "peer.id"
    path.write_bytes(b"garbage")
    rc, out = run_cotrain("train", "--host-maddrs", LOCALHOST, "--identity-path", str(path))
    lines = error_lines(out)
    assert rc != 0 and len(lines) == 1, out
    assert lines[0].startswith("cotrain train: error: identity file") and "Traceback" not in out


def joined_peer_id(role: Role, timeout: float, what: str) -> str:
    """The peer id a trainer joined with (its ``joined`` event), once it has joined."""
    return wait_until(lambda: events(role, "joined"), timeout, what=what)[0]["peer_id"]


@pytest.fixture(scope="module")
def swarm(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
    roles: dict[str, Role] = {}

    def monitor(name: str) -> list[str]:
        (out / "monitor" / "initial_peers.txt").unlink(missing_ok=True)
        identity = ["--identity-path", str(out / "keys" / "monitor.id")]
        roles[name] = Role(monitor_args(common, out / "monitor", *identity), out / f"{name}.log")
        return monitor_address(out / "monitor", 240)

    def trainer(name: str, initial: list[str], seed: int, *extra: str) -> Role:
        args = trainer_args(common, initial, demo_data, seed, out / name, "--statistics-expiration", "60")
        roles[name] = Role([*args, *extra], out / f"{name}.log")
        return roles[name]

    try:
        initial = monitor("monitor")
        trainer("server", initial, 1, "--identity-path", str(out / "keys" / "server.id"))
        trainer("client", initial, 2, "--client-mode")
        yield {
            "out": out,
            "roles": roles,
            "initial": initial,
            "data": demo_data,
            "monitor": monitor,
            "trainer": trainer,
        }
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_client_mode_trainer_averages_with_a_normal_one(swarm):
    roles, metrics = swarm["roles"], swarm["out"] / "monitor" / "metrics.jsonl"
    for name in ("server", "client"):
        wait_until(
            lambda name=name: any(r["group_size"] == 2 for r in trainer_rows(roles[name])),
            400,
            what=f"the {name} trainer to average in a group of 2",
        )
    wait_until(
        lambda: any(r["client_peers"] == 1 and r["alive_peers"] == 2 for r in read_rows(metrics)),
        120,
        what="the monitor to count one client among 2 trainers",
    )
    # a row's group size is that of the records already at its step when the monitor first sees the step
    wait_until(
        lambda: any(r["max_group_size"] == 2 for r in read_rows(metrics)),
        120,
        what="the monitor to log a step averaged in a group of 2",
    )


@pytest.mark.slow
def test_identity_files_are_created_private(swarm):
    for name in ("monitor.id", "server.id"):
        path = swarm["out"] / "keys" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    joined = joined_peer_id(swarm["roles"]["server"], 300, "the trainer to join")
    assert ensure_identity(swarm["out"] / "keys" / "server.id").to_base58() == joined


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_peer_with_a_used_identity_is_refused(swarm):
    joined_peer_id(swarm["roles"]["server"], 300, "the trainer to be online")
    rc, out = run_cotrain(
        "train",
        "--preset",
        "albert-tiny",
        "--run-id",
        RUN,
        "--host-maddrs",
        LOCALHOST,
        *FAST,
        "--initial-peers",
        *swarm["initial"],
        "--identity-path",
        str(swarm["out"] / "keys" / "server.id"),
        "--dataset-path",
        str(swarm["data"]),
    )
    lines = error_lines(out)
    assert rc is not None, f"a second peer with a used identity started:\n{out[-3000:]}"
    assert rc != 0 and len(lines) == 1, out
    assert "is already used by a running peer" in lines[0] and "Traceback" not in out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_restarted_trainer_keeps_its_peer_id(swarm):
    roles, out = swarm["roles"], swarm["out"]
    before = joined_peer_id(roles["server"], 300, "the trainer to be online")
    roles["server"].stop(timeout=60)
    again = swarm["trainer"](
        "server_again", swarm["initial"], 1, "--identity-path", str(out / "keys" / "server.id")
    )
    assert joined_peer_id(again, 360, "the restarted trainer to join") == before
    assert "already used by a running peer" not in again.text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_restarted_monitor_keeps_its_peer_id(swarm):
    roles = swarm["roles"]
    before = [a.split("/p2p/")[1] for a in swarm["initial"]]
    roles["monitor"].stop(timeout=60)
    after = [a.split("/p2p/")[1] for a in swarm["monitor"]("monitor_again")]
    assert set(after) == set(before) and len(set(before)) == 1, (before, after)


@pytest.mark.slow
def test_no_traceback_in_logs(swarm):
    for name, role in swarm["roles"].items():
        assert "Traceback" not in role.log_path.read_text(errors="replace"), name  # stopped roles included
