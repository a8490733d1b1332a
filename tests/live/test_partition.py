"""Self-healing membership.

Here, with cotrain processes; the rest in tests/swarm/test_partition.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FAST, ROLE_LOGS, _test_file, alive, cotrain_env, read_rows, wait_until

pytestmark = [pytest.mark.slow]


SUBNET = "10.91.0"


RATE_MBIT = 50


CUT_WAIT = 120  # seconds each wait while the link is down may take (the cut lasts about 25 s when idle)


EXPIRATION = 20  # seconds a trainer's metrics record stays valid at the monitor (the cut lasts past it)


RUN_ID = "partition-test"


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], check=check, capture_output=True, text=True, timeout=20)


class Hosts:
    """``n`` hosts, each a network namespace with ``eth0`` (10.91.0.<i+1>) on a bridge in a namespace of its
    own, every link shaped to ``rate_mbit`` both ways. Names carry this process's pid: parallel runs never
    collide."""

    PREFIX = "cotrain-part-"

    def __init__(self, n: int, rate_mbit: int):
        self.tag = f"{self.PREFIX}{os.getpid()}"
        self.n, self.rate_mbit = n, rate_mbit
        self.created: list[str] = []

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def ns(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        subprocess.run(
            ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
             "burst", "64kb", "latency", "50ms"],
            check=True, capture_output=True, text=True, timeout=20,
        )  # fmt: skip

    def create(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        sw = self.switch
        for i in range(self.n):
            ns = self.ns(i)
            self._add_ns(ns)
            _ip("-n", sw, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # what the host sends
            self._shape(self.switch, f"v{i}")  # what it receives

    def set_link(self, i: int, up: bool) -> None:
        _ip("-n", self.switch, "link", "set", f"v{i}", "up" if up else "down")

    def qdiscs(self, i: int) -> str:
        out = subprocess.run(["tc", "-n", self.ns(i), "qdisc", "show", "dev", "eth0"], capture_output=True,
                             text=True, timeout=20)  # fmt: skip
        return out.stdout

    def pids(self, name: str) -> list[int]:
        out = _ip("netns", "pids", name, check=False).stdout
        return [int(x) for x in out.split() if x.isdigit()]

    @classmethod
    def remove_stale(cls) -> None:
        """Delete namespaces left by an earlier run of this test whose process is gone (killed with -9)."""
        for line in _ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            pid = name[len(cls.PREFIX) :].split("-")[0]
            if name.startswith(cls.PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                stale = cls(0, 0)
                stale.created = [name]
                stale.close()

    def close(self) -> None:
        """Kill whatever still runs inside the namespaces, then delete them (their veths go with them)."""
        for name in reversed(self.created):
            for pid in self.pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "delete", name, check=False)
        self.created.clear()


class HostRole:
    """A `cotrain` command started inside host i's namespace, in its own process group like a terminal job."""

    def __init__(self, hosts: Hosts, i: int, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")
        ROLE_LOGS.append((_test_file(), log))  # a failed test's report shows the log's tail
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", hosts.ns(i), sys.executable, "-m", "cotrain", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=cotrain_env(),
            start_new_session=True,
        )

    def text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 20) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def _first_line(role: HostRole, text: str, after: float) -> tuple[float, str] | None:
    """(time.time(), line) of the first log line after ``after`` that contains ``text`` (hivemind's log
    format starts with a local timestamp ``Mon DD HH:MM:SS.fff``)."""
    for line in role.text().splitlines():
        if text not in line:
            continue
        stamp = line.split()[:3]
        try:
            t = time.strptime(f"{time.localtime().tm_year} {' '.join(stamp)[:-4]}", "%Y %b %d %H:%M:%S")
            when = time.mktime(t) + float("0." + stamp[2].split(".")[1])
        except (ValueError, IndexError):
            continue
        if when > after:
            return when, line
    return None


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    return None


@pytest.fixture
def hosts(network_guard):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    Hosts.remove_stale()
    net = Hosts(3, RATE_MBIT)
    try:
        try:
            net.create()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {e.stderr.strip() or e}")
        for name in net.created:  # peers in these namespaces listen on their namespace's address
            network_guard.allow_namespace(name)
        yield net
    finally:
        net.close()


@pytest.mark.timeout(240)  # about 2 minutes on an idle machine; the limit is for a loaded one
def test_a_cut_off_trainer_rejoins_and_contributes_again(hosts, demo_data, tmp_path):
    strategy = "diloco"
    for i in range(3):
        assert "tbf" in hosts.qdiscs(i) and f"{RATE_MBIT}Mbit" in hosts.qdiscs(i)

    def listen(i: int) -> list[str]:
        return ["--host-maddrs", f"/ip4/{hosts.address(i)}/tcp/0"]

    common = ["--preset", "albert-tiny", "--run-id", RUN_ID, *FAST, "--strategy", strategy]
    if strategy == "diloco":
        common += ["--local-steps", "2"]
    roles: dict[str, HostRole] = {}
    monitor_out = tmp_path / "monitor"
    try:
        roles["monitor"] = HostRole(
            hosts,
            0,
            ["monitor", *common, *listen(0), "--output-dir", str(monitor_out), "--refresh-period", "1",
             "--dashboard-port", "-1", "--save-every", "0"],
            tmp_path / "monitor.log",
        )  # fmt: skip
        peers_file = monitor_out / "initial_peers.txt"
        wait_until(peers_file.exists, 180, what="the monitor's address")
        initial = peers_file.read_text().split()
        assert initial and all(a.startswith(f"/ip4/{SUBNET}.1/") for a in initial), initial
        for i in (1, 2):
            roles[f"trainer{i}"] = HostRole(
                hosts,
                i,
                ["train", *common, *listen(i), "--initial-peers", *initial, "--dataset-path", str(demo_data),
                 "--seed", str(i), "--per-device-train-batch-size", "8",
                 "--statistics-expiration", str(EXPIRATION), "--output-dir", str(tmp_path / f"t{i}")],
                tmp_path / f"trainer{i}.log",
            )  # fmt: skip
        victim = roles["trainer2"]
        victim_rows = tmp_path / "t2" / "metrics.jsonl"
        trainer_rows = [tmp_path / "t1" / "metrics.jsonl", victim_rows]
        monitor_rows = monitor_out / "metrics.jsonl"

        def together() -> bool:  # both trainers averaged together at the same step: both hold the state
            # (a trainer that joined a step or two behind averages once before it has downloaded the state;
            # cut off then, the other trainer holds the swarm's state alone: healing.py)
            steps = [{r["step"] for r in read_rows(rows) if r["group_size"] >= 2} for rows in trainer_rows]
            return bool(steps[0] & steps[1])

        wait_until(together, 240, interval=1, what="the two trainers to average together")
        victim_pid = victim.proc.pid
        victim_id = victim.text().split("Trainer ", 1)[1].split()[0]

        cut_at = time.time()
        hosts.set_link(2, up=False)
        # the cut lasts until both sides have seen it: the trainer says it is cut off, and the monitor, once
        # the trainer's last record expired, counts the other trainer alone
        wait_until(
            lambda: _first_line(victim, "cut off from the swarm", after=cut_at),
            CUT_WAIT,
            interval=1,
            what="the trainer to notice it is cut off",
        )
        wait_until(
            lambda: [
                r
                for r in read_rows(monitor_rows)
                if r["time"] > cut_at + EXPIRATION + 2 and r["alive_peers"] == 1
            ],
            CUT_WAIT,
            interval=1,
            what="the monitor to count the trainers left",
        )
        step_at_heal = max(r["step"] for r in read_rows(monitor_rows))
        alone_rows = [r for r in read_rows(monitor_rows) if r["time"] > cut_at]
        healed_at = time.time()
        hosts.set_link(2, up=True)

        adopted_at, adopted_line = wait_until(
            lambda: _first_line(victim, "Adopted the swarm's state", after=healed_at),
            150,
            interval=1,
            what="the cut-off trainer to re-join and load the swarm's state",
        )

        def contributes() -> list[dict]:
            return [r for r in read_rows(victim_rows) if r["time"] > adopted_at and r["group_size"] >= 2]

        after = wait_until(contributes, 150, interval=1, what="the trainer to average with the swarm again")
        back_at_monitor = wait_until(
            lambda: [r for r in read_rows(monitor_rows) if r["time"] > healed_at and r["alive_peers"] == 2],
            120,
            interval=1,
            what="the monitor to count the trainer again",
        )
        status = subprocess.run(
            ["ip", "netns", "exec", hosts.ns(0), sys.executable, "-m", "cotrain", "status",
             "--run-id", RUN_ID, "--initial-peers", *initial, "--json"],
            capture_output=True, text=True, timeout=90, env=cotrain_env(),
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout.strip().splitlines()[-1])
        seen = {p["peer_id"]: p for p in state["peers"]}

        text = victim.text()
        cut_off_at, _ = _first_line(victim, "cut off from the swarm", after=cut_at) or (None, "")
        back_at, _ = _first_line(victim, "Back in the swarm", after=cut_at) or (None, "")
        adopted_step = int(adopted_line.split("Adopted the swarm's state at global step")[1].split()[0])
        summary = {
            "event": "partition_summary",
            "cut_seconds": round(healed_at - cut_at, 1),
            "rate_mbit": RATE_MBIT,
            "detected_after_s": round(cut_off_at - cut_at, 1) if cut_off_at else None,
            "back_after_heal_s": round(back_at - healed_at, 1) if back_at else None,
            "state_adopted_after_heal_s": round(adopted_at - healed_at, 1) if adopted_at else None,
            "swarm_step_at_heal": step_at_heal,
            "adopted_step": adopted_step,
            "first_step_averaged_again": after[0]["step"],
            "averaged_again_after_heal_s": round(after[0]["time"] - healed_at, 1),
            "monitor_counts_it_again_after_heal_s": round(back_at_monitor[0]["time"] - healed_at, 1),
            "swarm_steps_while_cut": len(alone_rows),
            "status_step_of_trainer": seen.get(victim_id, {}).get("step"),
            "status_global_step": state["global_step"],
        }
        print(json.dumps(summary))

        assert victim.proc.poll() is None and victim.proc.pid == victim_pid, "the trainer must not restart"
        assert "cut off from the swarm" in text and "Back in the swarm" in text, text[-3000:]
        assert cut_off_at is not None and back_at is not None and cut_off_at < healed_at < back_at
        # once its last record expired, the monitor counted only the other trainer
        late = [r for r in alone_rows if r["time"] > cut_at + EXPIRATION + 2]
        assert all(r["alive_peers"] == 1 for r in late), alone_rows
        assert adopted_step >= step_at_heal, (adopted_step, step_at_heal)  # the swarm's current state
        assert after[0]["step"] > adopted_step
        assert victim_id in seen, (victim_id, state)
        assert seen[victim_id]["step"] >= step_at_heal, (seen[victim_id], step_at_heal)
        for name, role in roles.items():
            assert role.proc.poll() is None, f"{name} exited: {role.text()[-2000:]}"
            assert "Traceback" not in role.text(), name
    finally:
        for role in roles.values():  # all at once, as when the machines shut down
            role.terminate()
        for role in roles.values():
            role.wait()

    def leftovers() -> dict[str, list[int]]:
        return {name: pids for name in hosts.created if (pids := alive(hosts.pids(name)))}

    deadline = time.monotonic() + 15  # SIGKILLed processes take a moment to disappear on a loaded machine
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers(), f"processes left in the namespaces: {leftovers()}"
