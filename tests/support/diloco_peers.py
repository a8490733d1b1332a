"""Live DiLoCo peers of tests/diloco_peer.py, each in a process of its own, and readers of what they
recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cotrain_env, wait_until

PEER = REPO / "tests" / "diloco_peer.py"


class Peer:
    """tests/diloco_peer.py in a process of its own, writing its JSON lines to ``out``."""

    def __init__(self, tmp: Path, name: str, *args: str):
        self.out = tmp / f"{name}.jsonl"
        self.read: list[dict] = []  # the rows read so far, up to byte ``self.offset`` of ``out``
        self.offset = 0
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--out", str(self.out), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=cotrain_env(),
            start_new_session=True,
        )

    def rows(self, event: str | None = None) -> list[dict]:
        """Its rows so far (of ``event``). Only the lines added since the last call are read: a round's rows
        carry whole vectors, and the waits poll every half second."""
        if self.out.exists():
            with open(self.out, "rb") as f:
                f.seek(self.offset)
                added = f.read()
            complete = added[: added.rfind(b"\n") + 1]  # a last line still being written waits
            self.offset += len(complete)
            self.read += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return [r for r in self.read if event is None or r["event"] == event]

    def address(self, timeout: float = 60) -> list[str]:
        return wait_until(lambda: self.rows("ready"), timeout, what=f"{self.out.stem} to start")[0]["maddrs"]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]


@pytest.fixture
def peers(tmp_path):
    started: list[Peer] = []

    def start(name: str, *args: str) -> Peer:
        started.append(Peer(tmp_path, name, *args))
        return started[-1]

    yield start
    for peer in started:
        peer.kill()
        peer.log.close()


def by_round(peer: Peer, event: str) -> dict[int, dict]:
    return {r["round"]: r for r in peer.rows(event)}


def joint_rounds(members: list[Peer]) -> list[int]:
    """Rounds in which every member averaged in a group of them all, and whole (a part that timed out on a
    loaded machine leaves the members apart by design until a later round carries the outer state)."""
    averages = [by_round(p, "average") for p in members]  # each file read once: its rows are large
    common = set.intersection(*(set(a) for a in averages))
    return [
        r
        for r in sorted(common)
        if all(a[r]["size"] == len(members) and not a[r]["partial"] for a in averages)
    ]
