"""A peer the swarm left behind (cotrain.hivemind_ext.optimizer.SwarmOptimizer.left_behind).

Here, with cotrain processes; the rest in tests/unit/hivemind_ext/test_catch_up.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import cotrain_env

SCRIPT = """
import json, logging, sys, time, torch, cotrain

role = sys.argv[1]
torch.manual_seed(1 if role == "a" else 2)
peer = cotrain.SwarmPeer(
    torch.nn.Linear(4, 1), optimizer=lambda params: torch.optim.SGD(params, lr=0.1), run_id="behind",
    target_batch_size=32, batch_size_per_step=8, host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=1.0,
    averaging_timeout=5.0, initial_peers=sys.argv[2:],
)
logging.basicConfig(level=logging.INFO)
epoch = 5 if role == "a" else 4
opt = peer.strategy.opt
if role == "b":  # it joined with the swarm's parameters; it stands for a peer that holds step 4's
    with torch.no_grad():
        peer.model.weight.add_(1.0)
opt.state_averager.local_epoch = epoch
opt.state_averager.state_sharing_priority = epoch
with opt.tracker.pause_updates():
    opt.tracker.update_epoch(epoch)
opt.tracker.report_local_progress(epoch, 8)  # hivemind publishes a peer's progress once it has samples
if role == "a":  # the swarm: it serves its state at step 5 until its input closes
    print(json.dumps({"maddrs": peer.maddrs, "weight": peer.model.weight.tolist()}), flush=True)
    sys.stdin.read()
    peer.shutdown()
    sys.exit(0)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if opt.tracker.global_epoch == 5 and opt.tracker.global_progress.num_peers == 2:
        break
    time.sleep(0.5)
seen = [opt.tracker.global_epoch, opt.tracker.global_progress.num_peers]
# hivemind checks once per step that a peer is at the swarm's exact step, once it has fetched the swarm's
# progress; b is where that check was spent (it had just loaded step 4, the step the swarm was then at)
opt._should_check_synchronization_on_update = False
before = peer.model.weight.detach().clone()
loss = peer.model(torch.randn(8, 4)).pow(2).mean()
loss.backward()
peer.step(loss=loss.item())
out = {"seen": seen, "step": peer.global_step, "weight": peer.model.weight.tolist(),
       "moved": not bool(torch.equal(peer.model.weight.detach(), before))}
peer.shutdown()
print(json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_newcomer_the_swarm_left_behind_loads_its_state_instead_of_stepping_alone():
    # two processes: the peers of one process share one signing key, hence one entry in the swarm's progress
    command = [sys.executable, "-c", SCRIPT]
    a = subprocess.Popen(
        [*command, "a"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=cotrain_env()
    )
    try:
        swarm = json.loads(a.stdout.readline())
        b = subprocess.run(
            [*command, "b", *swarm["maddrs"]], capture_output=True, text=True, env=cotrain_env(), timeout=200
        )
    finally:
        a.stdin.close()
        a.wait(timeout=60)
    assert b.returncode == 0, b.stdout + b.stderr[-4000:]
    found = json.loads(b.stdout.strip().splitlines()[-1])
    assert found["seen"] == [5, 2], found  # b sees the swarm one step ahead, with both peers
    assert "loading the swarm's state instead of stepping alone" in b.stderr, b.stderr[-4000:]
    # b holds the swarm's step and parameters: a download, not an optimizer step on its 8 samples
    assert found["step"] == 5 and found["moved"] and found["weight"] == swarm["weight"], (found, swarm)
