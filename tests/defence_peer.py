"""A synchronous peer for the live tests of the defences: cotrain.SwarmPeer on a small regression model.

Each peer fits the same linear map from data of its own seed with SGD. After every global step it writes, as a
JSON line in --out, the step, the samples it trained on since the previous step (its own count, whatever it
told the swarm), and its metrics report (group size, rounds averaged and failed). An attack comes from the
environment (COTRAIN_ATTACK, cotrain.faults).

    python tests/defence_peer.py --out a.jsonl --steps 6 [--initial-peers ADDR] [--aggregation centered-clip]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import cotrain
from peer_task import DIM, INIT_SEED, Task, jsonl, peer_arguments


def main() -> None:
    p = peer_arguments(target_batch_size=96, step_sleep=0.1, run_id="defence-test")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--aggregation", default="mean")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(INIT_SEED)
    model = torch.nn.Linear(DIM, 1)
    task, (emit, close) = Task(args.seed), jsonl(args.out)

    peer = cotrain.SwarmPeer(
        model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        batch_size_per_step=args.batch,
        matchmaking_time=2.0,
        averaging_timeout=20.0,
        load_state_timeout=30.0,
        startup_timeout=30.0,
        aggregation=args.aggregation,
        torch_threads=1,
    )
    with peer:
        emit(event="ready", maddrs=peer.maddrs, step=peer.global_step, at=time.time())
        # --steps count from the first global step this peer takes: a newcomer catches up with the swarm there
        start, samples = None, 0
        while (
            start is None
            or peer.global_step < start + args.steps
            or (args.until and not Path(args.until).exists())
        ):
            loss = task.loss(model, args.batch)
            loss.backward()
            time.sleep(args.step_sleep)
            samples += args.batch
            if peer.step(loss=loss.item()):
                start = peer.global_step - 1 if start is None else start
                emit(**peer.last_report, event="step", samples=samples, at=time.time())
                samples = 0
    emit(event="done", step=peer.global_step)
    close()
    sys.exit(0)


if __name__ == "__main__":
    main()
