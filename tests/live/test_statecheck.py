"""State downloads that a malicious donor cannot poison (cotrain.hivemind_ext.statecheck).

Here, with cotrain processes; the rest in tests/swarm/test_statecheck.py and
tests/unit/hivemind_ext/test_statecheck.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, alive, cotrain_env, read_rows, wait_until

ATTACK_ENV = {"COTRAIN_ATTACK": "poisoned-state"}


def relative_gap(a: list[float], b: list[float]) -> float:
    a_, b_ = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a_ - b_).norm() / b_.norm())


PEER = REPO / "tests" / "statecheck_peer.py"


class Peer:
    """This file run as a peer script, in its own process group, its JSON lines in ``out``."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict | None = None):
        self.name, self.out, self.log = name, tmp / f"{name}.jsonl", tmp / f"{name}.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--out", str(self.out), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**cotrain_env(), **(env or {})},
            start_new_session=True,
        )
        self.pgid = os.getpgid(self.proc.pid)

    def rows(self, event: str | None = None) -> list[dict]:
        return [r for r in read_rows(self.out) if event is None or r["event"] == event]

    def text(self) -> str:
        self._log.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # hivemind's DHT, p2pd and averagers, if any are left
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self._log.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
# diloco only (suite time): the sync strategy's state holder downloads through the same checked path, live in
# test_a_newcomer_takes_the_witnessed_step_not_a_lone_peer_far_ahead and the unreachable donor's test above
@pytest.mark.parametrize("strategy", ["diloco"])
def test_a_newcomer_refuses_the_poisoned_donor_and_loads_an_honest_state(strategy, tmp_path):
    steps, stop = 5, tmp_path / "stop"
    go = tmp_path / "go"  # the 3 peers start training together once all have joined
    common = ["--strategy", strategy, "--run-id", f"statecheck-{strategy}", "--until", str(stop)]
    peers: dict[str, Peer] = {}
    try:
        trainer = [*common, "--steps", str(steps), "--go", str(go)]
        peers["h1"] = Peer(tmp_path, "h1", [*trainer, "--seed", "1"])
        initial = wait_until(lambda: peers["h1"].rows("ready"), 60, what="the first peer")[0]["maddrs"]
        join = ["--initial-peers", *initial]
        peers["h2"] = Peer(tmp_path, "h2", [*trainer, *join, "--seed", "2"])
        peers["liar"] = Peer(tmp_path, "liar", [*trainer, *join, "--seed", "3"], ATTACK_ENV)

        wait_until(lambda: all(p.rows("ready") for p in peers.values()), 60, what="3 peers joined")
        go.touch()

        def idle() -> dict | None:
            done = {name: p.rows("idle") for name, p in peers.items()}
            return done if all(done.values()) else None

        done = wait_until(idle, 150, what=f"3 peers at step {steps}")
        step = done["h1"][-1]["step"]
        assert step >= steps and all(rows[-1]["step"] == step for rows in done.values()), done
        ids = {name: p.rows("ready")[0]["peer_id"] for name, p in peers.items()}
        honest = {name: peers[name].rows("state")[-1]["values"] for name in ("h1", "h2")}
        gap_honest = relative_gap(honest["h1"], honest["h2"])

        newcomer = peers["new"] = Peer(tmp_path, "new", [*common, *join, "--newcomer"])
        loaded = wait_until(lambda: newcomer.rows("loaded"), 90, what="the newcomer's download")[0]
        text = newcomer.text()
        # the poisoned donor was asked first (the highest priority) and named, and an honest state was loaded:
        # checked against the initial peer's own fingerprint where it vouches (an API peer serves its record
        # to newcomers), else against the other peers' records
        refused = f"Peer {ids['liar']} served a state for step {step} that "
        assert refused in text and "not loading it, trying another peer" in text, text[-4000:]
        assert "(COTRAIN_ATTACK=poisoned-state): serving a poisoned state" in peers["liar"].text()
        assert loaded["step"] == step, loaded
        honest_words = (f"for step {step} matches", f"for step {step} is the initial peer's own")
        honest_words += (f"for step {step} is vouched for by the initial peer",)
        matched = [
            h for h in ("h1", "h2") if any(f"The state from peer {ids[h]} {w}" in text for w in honest_words)
        ]
        assert matched, text[-4000:]
        gaps = {name: relative_gap(loaded["values"], values) for name, values in honest.items()}
        print(f"{strategy}: honest peers differ by {gap_honest:.2e}; the newcomer from them by {gaps}")
        assert min(gaps.values()) < 1e-6, gaps  # a copy of one honest peer's state, not the poisoned one
        assert "Traceback" not in text
    finally:
        stop.touch()
        for p in peers.values():
            p.stop()
    assert not alive([p.proc.pid for p in peers.values()])
