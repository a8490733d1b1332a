"""A short byzantine swarm: three trainers of a small regression model (cotrain.SwarmPeer, sync strategy, real
hivemind all-reduces on 127.0.0.1), one of them malicious (COTRAIN_ATTACK=sign-flip). The sign-flipped
gradient goes on the wire and, with the mean, into the honest trainers' steps: they move far away from the
solution."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cotrain_env
from cotrain.faults import ATTACK

PEER = r"""
import json, os, sys, time, torch, cotrain
run_id, steps, index, go, initial = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
torch.set_num_threads(1)
torch.manual_seed(0)  # the same initial parameters on every trainer
model = torch.nn.Linear(16, 1)
target = torch.arange(16, dtype=torch.float32) / 16
data = torch.Generator().manual_seed(index)  # each trainer's own data
held_out = torch.randn(256, 16, generator=torch.Generator().manual_seed(123))

def loss_of(x):
    return torch.nn.functional.mse_loss(model(x).squeeze(-1), x @ target)

peer = cotrain.SwarmPeer(
    model,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.2),
    run_id=run_id,
    target_batch_size=48,
    initial_peers=initial,
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    batch_size_per_step=8,
    matchmaking_time=3.0,
    averaging_timeout=15.0,
    load_state_timeout=20.0,
    startup_timeout=30.0,
    max_grad_norm=1.0,
    torch_threads=1,
)
with peer:
    print("READY " + json.dumps(peer.maddrs), flush=True)
    while not os.path.exists(go):  # all three have joined: train together
        time.sleep(0.2)
    with torch.no_grad():
        start = worst = loss_of(held_out).item()
    groups = []  # the averaging group's size at each global step
    deadline = time.monotonic() + 90
    while peer.global_step < steps and time.monotonic() < deadline:
        x = torch.randn(8, 16, generator=data)
        loss = loss_of(x)
        loss.backward()
        before = peer.global_step
        peer.step(loss=loss.item())
        if peer.global_step > before:
            groups.append(peer.last_group_size)
        with torch.no_grad():
            worst = max(worst, loss_of(held_out).item())
        time.sleep(0.3)
    with torch.no_grad():
        end = loss_of(held_out).item()
    result = {"start": start, "end": end, "worst": worst, "step": peer.global_step, "groups": groups}
    print("RESULT " + json.dumps(result), flush=True)
"""


class Swarm:
    """Three trainers of PEER in processes of their own; the last one gets ``attack`` in its environment."""

    def __init__(self, run_id: str, attack: str, go: Path, steps: int = 6):
        self.procs: list[subprocess.Popen] = []
        self.run_id, self.steps, self.go = run_id, steps, go
        first = self._start(0, [], "")
        address = [a for a in self._ready(first) if "/127.0.0.1/" in a]
        joining = [self._start(i, address, attack if i == 2 else "") for i in (1, 2)]  # both at once
        for proc in joining:
            self._ready(proc)
        go.touch()

    def _start(self, index: int, initial: list[str], attack: str) -> subprocess.Popen:
        env = {**cotrain_env(), ATTACK: attack}
        proc = subprocess.Popen(
            [sys.executable, "-c", PEER, self.run_id, str(self.steps), str(index), str(self.go), *initial],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def _ready(proc: subprocess.Popen) -> list[str]:
        seen = []
        for line in proc.stdout:
            if line.startswith("READY "):
                return json.loads(line[len("READY ") :])
            seen.append(line)
        raise AssertionError("a trainer did not start: " + "".join(seen)[-3000:])

    def results(self, timeout: float = 150) -> list[dict]:
        deadline = time.monotonic() + timeout
        out = []
        for proc in self.procs:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            assert lines, text[-3000:]
            out.append(json.loads(lines[-1][len("RESULT ") :]))
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sign_flipped_gradient_reaches_the_honest_trainers_through_the_mean(tmp_path):
    swarm = None
    try:
        swarm = Swarm("byzantine-attacked", "sign-flip", tmp_path / "go-attacked")
        results = swarm.results()
    finally:
        if swarm is not None:
            swarm.kill()
    for r in results[:2]:
        assert r["step"] >= 3, results
    # the honest trainers are thrown far from the solution: their held-out loss, checked after every step,
    # rises far above where it started (the same swarm without the attacker halved it in these 6 steps, never
    # rising past 1.5 x: 5.98 -> 3.2-3.5 in the runs that measured it). They may recover before the end: once
    # their gradients are large, the attacker's x1000 parts overflow fp16, are refused as non-finite (in both
    # modes) and the attacker is excluded.
    assert all(not r["worst"] < 10 * r["start"] for r in results[:2]), results
