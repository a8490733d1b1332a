"""Live test of the defences against malicious peers on 127.0.0.1: a peer that inflates its progress does not
make the swarm step early. (A silent group member: tests/live/test_attacks.py; a poisoned donor:
tests/live/test_statecheck.py; clipped gradients: tests/swarm/test_robust.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, cotrain_env, read_rows, wait_until

PEER = REPO / "tests" / "defence_peer.py"


TARGET = 96  # samples per global step; micro-batches of 8


class Peer:
    """tests/defence_peer.py in a process of its own (``attack``: its COTRAIN_ATTACK)."""

    def __init__(self, tmp: Path, name: str, *args: str, attack: str = ""):
        self.out, self.log_path = tmp / f"{name}.jsonl", tmp / f"{name}.log"
        env = cotrain_env()
        if attack:
            env["COTRAIN_ATTACK"] = attack
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--out", str(self.out), "--target-batch-size", str(TARGET), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def rows(self, event: str) -> list[dict]:
        return [r for r in read_rows(self.out) if r["event"] == event]

    def address(self) -> list[str]:
        return wait_until(lambda: self.rows("ready"), 90, what=f"{self.out.stem} to start")[0]["maddrs"]

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def peers(tmp_path):
    started: list[Peer] = []

    def start(name: str, *args: str, attack: str = "") -> Peer:
        started.append(Peer(tmp_path, name, *args, attack=attack))
        return started[-1]

    yield start
    for peer in started:
        peer.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_inflated_progress_does_not_trigger_early_steps(peers, tmp_path):
    # a trains with the attacker c until the newcomer b has taken 8 global steps with them
    done = tmp_path / "done"
    robust = ["--aggregation", "centered-clip"]
    a = peers("a", "--steps", "8", "--until", str(done), *robust)
    address = a.address()
    c = peers(
        "c", "--steps", "1", "--seed", "2", "--until", str(done), "--initial-peers", *address, *robust,
        attack="inflate-progress",
    )  # fmt: skip

    def last_step(peer: Peer) -> int:
        return max((r["step"] for r in peer.rows("step")), default=-1)

    # Beside a alone nothing caps the liar's claim (the median of two claims is their mean): it ends its own
    # steps at once, and when a's averaging misses one of them it runs ahead of a, which ignores an epoch
    # that a single peer reports (2 runs in 3; in the others the two step together at the liar's pace)
    deadline = time.monotonic() + 30
    while last_step(c) < last_step(a) + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    b = peers("b", "--steps", "8", "--seed", "1", "--initial-peers", *address, *robust)
    try:
        assert b.proc.wait(180) == 0, b.text()[-3000:]
    finally:
        done.touch()
    assert a.proc.wait(60) == 0, a.text()[-3000:]
    assert "inflate-progress" in c.text() and c.rows("step"), c.text()[-3000:]  # the attack was on
    # The newcomer loaded a's state, not the liar's far ahead: holding the liar's epoch, it would have been
    # the second witness that a's progress tracker asks for, and a would have followed the liar's epochs
    joined = b.rows("ready")[0]
    at_join = max(r["step"] for r in a.rows("step") if r["at"] <= joined["at"])
    assert joined["step"] <= at_join + 1, (joined, at_join, last_step(c))
    # and a, once b is in, does not jump to the liar's epochs (before, beside the liar alone, it may: one
    # honest peer against one liar is a tie that nothing breaks)
    a_steps = [r["step"] for r in a.rows("step") if r["at"] >= joined["at"]]
    assert max(y - x for x, y in zip(a_steps, a_steps[1:], strict=False)) <= 2, a_steps
    # Once the newcomer is in, the honest peers still train on about their share of the target at each global
    # step (96 samples by 3 peers of the same speed: 64 for the two; 40-64 measured on a loaded machine): the
    # liar's claim of 1000 x its samples counts as at most twice the median peer's. Without the cap its first
    # micro-batch (8 samples, claimed as 8000) would end every step at once, and the two honest peers would
    # train 8 samples each per step, 16 together. Counted per global step of the swarm (a's steps) rather than
    # per peer: a peer that joined one epoch behind may stay there, stepping at once with one micro-batch into
    # the others' all-reduce each time (b in one run: 8 per step while a trained 32). Only while b trains:
    # once it has left, a steps beside the liar alone, where nothing caps the liar's claim.
    left = b.rows("step")[-1]["at"]
    window = [(p, r) for p in (a, b) for r in p.rows("step") if joined["at"] + 3 < r["at"] <= left]
    steps = sum(1 for p, _ in window if p is a)
    assert steps >= 4, window
    per_step = sum(r["samples"] for _, r in window) / steps
    assert per_step >= 28, [(p.out.stem, r["step"], r["samples"]) for p, r in window]
