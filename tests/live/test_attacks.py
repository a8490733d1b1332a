"""Fault injection of malicious peers (cotrain.faults, COTRAIN_ATTACK).

Here, with cotrain processes; the rest in tests/swarm/test_attacks.py and
tests/unit/hivemind_ext/test_attacks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import cotrain_env
from cotrain.faults import ATTACK, ATTACK_SCALE

PEER_SCRIPT = r"""
import json, sys, torch, cotrain
strategy = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
peer = cotrain.SwarmPeer(
    model,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    run_id="attack-hooks",
    target_batch_size=10**6,
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    max_grad_norm=1.0,
    torch_threads=1,
    startup_timeout=30.0,
    strategy=strategy,
    local_steps=1,
)
with peer:
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():  # a gradient of norm 2 x sqrt(36) = 12, clipped to 1 by the engine
        p.grad = torch.full_like(p, 2.0)
    peer.step(batch_size=4)
    opt = peer.strategy.opt
    moved = [(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)]
    out = {"moved": torch.cat(moved).tolist()}
    if strategy == "sync":
        out["sent"] = torch.cat([t.reshape(-1) for t in opt.grad_averager._grad_accumulators()]).tolist()
        out["weight"] = opt.grad_averager.local_samples_accumulated
    else:
        own = opt._own_change()
        sent, _ = opt._payload(own)  # what this round sends: where the attack applies
        control = opt._launch(sent, opt.samples)
        with opt.outer_averager.get_tensors() as tensors:
            out["sent"] = torch.cat([t.reshape(-1) for t in tensors[: len(own)]]).tolist()
        control.cancel()
        out["own"] = torch.cat([t.reshape(-1) for t in own]).tolist()
        out["weight"] = opt.samples
    out["progress"] = opt.tracker.local_progress.samples_accumulated
    print("RESULT " + json.dumps(out), flush=True)
"""


def run_peers(cases: list[tuple[str, str]]) -> list[dict]:
    """PEER_SCRIPT once per (strategy, attack), in processes of their own at the same time."""
    procs = []
    for strategy, attack in cases:
        env = {**cotrain_env(), ATTACK: attack}
        env.pop(ATTACK_SCALE, None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PEER_SCRIPT, strategy],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
        )
    results = []
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=150)
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, text[-3000:]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return results


CLIPPED = 2.0 / 12.0  # each value of the clipped gradient


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_sync_strategy_sends_the_attacked_gradient_past_the_engines_checks():
    honest, flipped, nan, inflated = run_peers(
        [("sync", ""), ("sync", "sign-flip"), ("sync", "nan"), ("sync", "inflate-progress")]
    )
    torch.testing.assert_close(torch.tensor(honest["sent"]), torch.full((36,), CLIPPED))
    assert honest["weight"] == honest["progress"] == 4
    # clipped first (the engine's clipping), then flipped: what the all-reduce would carry
    torch.testing.assert_close(torch.tensor(flipped["sent"]), torch.full((36,), -1000 * CLIPPED))
    # NaN/Inf after the finiteness check: not dropped, on the wire
    assert not torch.isfinite(torch.tensor(nan["sent"])).any()
    torch.testing.assert_close(torch.tensor(inflated["sent"]), torch.full((36,), CLIPPED))
    assert inflated["weight"] == inflated["progress"] == 4000


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_diloco_sends_the_attacked_pseudo_gradient_and_steps_honestly_itself():
    honest, flipped, inflated = run_peers(
        [("diloco", ""), ("diloco", "sign-flip"), ("diloco", "inflate-progress")]
    )
    for peer in (honest, flipped, inflated):
        # the inner SGD step (lr 0.1) on the clipped, honest gradient
        torch.testing.assert_close(torch.tensor(peer["moved"]), torch.full((36,), -0.1 * CLIPPED))
        torch.testing.assert_close(torch.tensor(peer["own"]), torch.full((36,), 0.1 * CLIPPED))
    torch.testing.assert_close(torch.tensor(honest["sent"]), torch.tensor(honest["own"]))
    torch.testing.assert_close(torch.tensor(flipped["sent"]), -1000 * torch.tensor(flipped["own"]))
    assert honest["weight"] == honest["progress"] == 4
    assert inflated["weight"] == inflated["progress"] == 4000
