"""cotrain.net.healing: what a peer back from a partition loads.

Two live `cotrain.SwarmPeer`s of one run on 127.0.0.1, in one process. Peer a stands for a trainer that was
cut off at step 3 and took steps alone up to 5; peer b for a laggard that joined a step or two behind just
before the cut and still holds step 1 (it could not download the state since). Back in the swarm, a does not
adopt b's state, which is older than what the swarm had when they parted; it goes on with its own. Without
that floor the same download replaces a's state with b's step 1 (what a rare run of
tests/live/test_partition.py showed: the swarm fell back from step 5 to 1).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import cotrain_env

SCRIPT = """
import json, logging, time, torch, cotrain
from cotrain.net.served import served_epochs

def peer(seed, **kwargs):
    torch.manual_seed(seed)
    return cotrain.SwarmPeer(
        torch.nn.Linear(4, 1), optimizer=lambda params: torch.optim.SGD(params, lr=0.1), run_id="floor",
        target_batch_size=8, batch_size_per_step=8, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **kwargs,
    )

logging.basicConfig(level=logging.INFO)
a = peer(1)
b = peer(2, initial_peers=a.maddrs)
for p, epoch in ((a, 5), (b, 1)):
    p.strategy.opt.state_averager.local_epoch = epoch
    p.strategy.opt.state_averager.state_sharing_priority = epoch
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    served = sorted(served_epochs(a.dht, "floor").values())
    if served == [1.0, 5.0]:
        break
    time.sleep(0.5)
weights = a.model.weight.detach().clone()
kept = a.strategy.adopt_swarm_state(lambda: False, 3)
out = {"served": served, "kept": not kept, "step_kept": a.global_step,
       "weights_kept": bool(torch.equal(weights, a.model.weight.detach()))}
adopted = a.strategy.adopt_swarm_state(lambda: False, 0)
out.update(adopted=adopted, step_adopted=a.global_step,
           weights_adopted=bool(torch.equal(b.model.weight.detach(), a.model.weight.detach())))
b.shutdown()
a.shutdown()
print(json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_back_from_a_partition_does_not_adopt_a_state_older_than_its_step_at_the_cut():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=cotrain_env(), timeout=200
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["served"] == [1.0, 5.0], found  # both serve their state, at their steps
    # the floor: b's step 1 is below a's step at the cut (3): a keeps its own state and step
    assert found["kept"] and found["step_kept"] == 5 and found["weights_kept"], found
    assert "goes on with its own" in done.stderr
    # no floor: the same download replaces a's state with the laggard's
    assert found["adopted"] and found["step_adopted"] == 1 and found["weights_adopted"], found
