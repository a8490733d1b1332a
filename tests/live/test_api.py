"""cotrain.SwarmPeer, the API for training loops of one's own.

Here, with cotrain processes; the rest in tests/unit/engine/test_api.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import (
    LOCALHOST,
    REPO,
    Role,
    alive,
    cotrain_env,
    monitor_address,
    monitor_args,
    read_rows,
    wait_until,
)

EXAMPLE = REPO / "examples" / "custom_loop.py"


STEPS = 8


def test_importing_cotrain_loads_neither_torch_nor_hivemind():
    code = "import sys, cotrain; print(sorted({'torch', 'hivemind'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cotrain_env())
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
    code = "import cotrain; print(cotrain.SwarmPeer.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cotrain_env())
    assert out.stdout.strip() == "cotrain.engine.peer", out.stderr


def as_in_a_terminal() -> None:
    """In the child before it runs: SIGINT at its default, as in a terminal (a CI job or a script's background
    job may start everything with SIGINT ignored, which Python then leaves ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Example:
    """examples/custom_loop.py started as a user would in a terminal, in its own process group."""

    def __init__(self, args: list[str], out: Path):
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            stdout=open(out.with_suffix(".jsonl"), "w"),
            stderr=open(out.with_suffix(".log"), "w"),
            env=cotrain_env(),
            start_new_session=True,
            preexec_fn=as_in_a_terminal,
        )

    def events(self) -> list[dict]:
        rows = []
        for line in self.out.with_suffix(".jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return rows

    def steps(self) -> list[dict]:
        return [e for e in self.events() if e.get("event") == "step"]

    def tree(self) -> list[int]:
        try:
            return [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_custom_loops_train_together_the_monitor_shows_them_and_ctrl_c_stops_one(tmp_path):
    """docs/api.md's example: a first loop that trains on until Ctrl+C, and a second that joins it and trains
    STEPS global steps from the one it joined at, then exits 0. Both averaged with each other and the monitor
    logged them; Ctrl+C to the first one's terminal group stops it (exit 130) and leaves no process."""
    run = ["--run-id", "api-test", "--host-maddrs", LOCALHOST]
    monitor = Role(
        monitor_args([*run, "--target-batch-size", "128"], tmp_path / "monitor", "--save-every", "0"),
        tmp_path / "monitor.log",
    )
    peers: list[Example] = []
    try:
        initial = monitor_address(tmp_path / "monitor", 120)
        # a target of 16 micro-batches: the first peer steps alone until the second joins it
        args = [*run, "--initial-peers", *initial, "--target-batch-size", "128"]
        first = Example([*args, "--steps", "100000", "--seed", "1"], tmp_path / "peer1")
        peers.append(first)
        wait_until(lambda: first.steps() or first.proc.poll() is not None, 150, what="the first peer's step")
        second = Example([*args, "--steps", str(STEPS), "--seed", "2"], tmp_path / "peer2")
        peers.append(second)
        wait_until(lambda: second.steps() or second.proc.poll() is not None, 150, what="the second's step")
        trees = second.tree()  # its DHT, p2pd and averager processes too
        second.proc.wait(timeout=200)
        log = second.out.with_suffix(".log").read_text()
        assert second.proc.returncode == 0 and "Traceback" not in log, log[-3000:]
        events = second.events()
        assert events[0]["event"] == "ready", events
        assert events[-1] == {"event": "done", "step": events[0]["step"] + STEPS}, events
        assert any(s["group_size"] == 2 for s in second.steps()), events  # averaged with the first peer
        # hivemind's processes end within seconds of the script (shutdown() stops them in order)
        wait_until(lambda: not alive(trees), 15, what="the second peer's processes to end")

        # Ctrl+C in the first one's terminal: the whole process group. hivemind's averager left SIGINT
        # ignored in the script's process, and the terminal's SIGINT reaches the peer's p2pd daemon too,
        # whose handlers the shutdown then waited for
        assert first.proc.poll() is None, first.out.with_suffix(".log").read_text()[-3000:]
        tree = first.tree()
        assert len(tree) >= 2, tree  # the script and its p2pd daemon
        os.killpg(first.proc.pid, signal.SIGINT)
        first.proc.wait(timeout=30)  # 2-5 s on an idle machine
        log = first.out.with_suffix(".log").read_text()
        assert first.proc.returncode == 130 and "stopped (Ctrl+C)" in log and "Traceback" not in log, log[
            -3000:
        ]
        wait_until(lambda: not alive(tree), 10, what="the first peer's processes to end")
        steps = first.steps()
        assert any(s["group_size"] == 2 for s in steps), steps
        assert steps[-1]["loss"] < steps[0]["loss"] - 0.1, steps
        rows = [r for r in read_rows(tmp_path / "monitor" / "metrics.jsonl") if r.get("loss") is not None]
        assert rows and max(r["alive_peers"] for r in rows) == 2, rows
        assert max(r["max_group_size"] for r in rows) == 2 and max(r["step"] for r in rows) >= STEPS - 1
        assert rows[-1]["loss"] < rows[0]["loss"], rows
    finally:
        for peer in peers:
            if peer.proc.poll() is None:
                peer.kill()
        monitor.stop()


def first_example() -> tuple[list[str], str]:
    """docs/api.md's first two blocks: the monitor's command line (without `cotrain`) and the loop's code."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", (REPO / "docs" / "api.md").read_text(), re.S)
    command = shlex.split(next(code for kind, code in blocks if kind == "bash"))
    assert command[:2] == ["cotrain", "monitor"], command
    return command[1:], next(code for kind, code in blocks if kind == "python")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_docs_first_example_trains_against_its_monitor_and_a_mismatched_loop_is_refused(tmp_path):
    """docs/api.md's first example, as written, in a folder of its own: its monitor command (its output folder
    in this test's, no dashboard), then its loop, which trains two global steps that the monitor logs. The
    same loop with another target batch exits non-zero naming the setting, before any step."""
    args, loop = first_example()
    args[args.index("--output-dir") + 1] = str(tmp_path / "out")
    monitor = Role([*args, "--dashboard-port", "-1", "--refresh-period", "0.5"], tmp_path / "monitor.log")

    def run(code: str) -> subprocess.CompletedProcess:
        (tmp_path / "my_loop.py").write_text(code)
        command = [sys.executable, "my_loop.py"]
        return subprocess.run(
            command, cwd=tmp_path, env=cotrain_env(), capture_output=True, text=True, timeout=200
        )

    try:
        monitor_address(tmp_path / "out", 120)
        # a monitor of no preset also says how a loop of one's own joins, with the settings it must share
        assert "or, from a training loop of one's own (docs/api.md):" in monitor.text()
        assert "cotrain.SwarmPeer(model, optimizer, run_id='my-run', target_batch_size=64, " in monitor.text()
        ran = run(loop)
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert "global step 2 averaged with" in ran.stdout, ran.stdout
        assert "Traceback" not in ran.stderr and "unrecognized" not in ran.stderr, ran.stderr[-3000:]

        def logged() -> list[dict]:  # the monitor's rows of the loop's global steps
            return [r for r in read_rows(tmp_path / "out" / "metrics.jsonl") if r.get("loss") is not None]

        wait_until(lambda: any(r["step"] >= 1 for r in logged()), 30, what="the monitor to log the steps")
        mismatched = loop.replace("target_batch_size=64", "target_batch_size=4096")
        assert mismatched != loop
        refused = run(mismatched)
        assert refused.returncode != 0 and "global step" not in refused.stdout, refused.stdout
        assert "ConfigMismatch" in refused.stderr and "target_batch_size 4096 != 64" in refused.stderr
    finally:
        monitor.stop()


LEAVE = """
import sys, threading, torch, cotrain
peer = cotrain.SwarmPeer(
    torch.nn.Linear(2, 1), optimizer=lambda params: torch.optim.SGD(params, lr=0.1), run_id="leave",
    target_batch_size=8, host_maddrs=["/ip4/127.0.0.1/tcp/0"], strategy=sys.argv[1],
)
names = lambda: [t.name for t in threading.enumerate()]
assert "stop-rounds" in names(), names()
peer._stop.set()  # as a role's signal handler does: rounds are cancelled until the peer has left
threading.Event().wait(0.5)
if sys.argv[2] == "shutdown":
    peer.shutdown()
    assert "stop-rounds" not in names(), names()
print("left", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["shutdown", "exit"])
def test_a_peer_that_left_keeps_no_thread_cancelling_its_rounds(how):
    # a round's future keeps its state in a torch tensor: a thread still cancelling rounds at interpreter
    # exit was ended inside a torch call and aborted the process ("terminate called without an active
    # exception"); left by shutdown() or by its finalizer at exit, the peer ends that thread first
    runs = {  # both strategies at once
        strategy: subprocess.Popen(
            [sys.executable, "-c", LEAVE, strategy, how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cotrain_env(),
        )
        for strategy in ("sync", "diloco")
    }
    try:
        for strategy, proc in runs.items():
            stdout, stderr = proc.communicate(timeout=150)
            assert proc.returncode == 0 and "left" in stdout, (strategy, stdout + stderr[-3000:])
            assert "terminate called" not in stderr, strategy
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
