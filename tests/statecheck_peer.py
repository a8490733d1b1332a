"""A peer of the live state-check test (tests/live/test_statecheck.py): cotrain.SwarmPeer on the peer task
(tests/peer_task.py), writing what it served and loaded as JSON lines.

    python tests/statecheck_peer.py --out a.jsonl [--strategy diloco] [--initial-peers ADDR] [--newcomer]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from peer_task import DIM, INIT_SEED, Task, flat, jsonl


def main() -> None:
    import cotrain

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="sync")
    p.add_argument("--run-id", default="statecheck")
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--steps", type=int, default=3, help="train until this global step, then serve")
    p.add_argument("--until", help="serve until this file exists")
    p.add_argument("--newcomer", action="store_true", help="join, write the state loaded, leave")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--go", help="start training once this file exists (waiting up to 90 s)")
    args = p.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(INIT_SEED)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    task, (emit, _) = Task(args.seed), jsonl(args.out)

    peer = cotrain.SwarmPeer(
        model,
        # small steps, as a real model's (~0.5% of a tensor's values per step): a peer that stepped without
        # the group's average stays well within the check's tolerance of the others
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        run_id=args.run_id,
        target_batch_size=32,
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        batch_size_per_step=8,
        matchmaking_time=2.0,
        averaging_timeout=10.0,
        load_state_timeout=30.0,
        startup_timeout=30.0,
        strategy=args.strategy,
        local_steps=3,
        torch_threads=1,
    )
    holder = peer.strategy.opt.state_averager

    def served() -> list[float]:
        with holder.lock_averaged_tensors:
            return flat(holder.fingerprinted_tensors())

    with peer:
        emit(event="ready", maddrs=peer.maddrs, peer_id=peer.peer_id, step=peer.global_step)
        if args.newcomer:
            emit(event="loaded", step=peer.global_step, values=served())
            return
        deadline = time.monotonic() + 90
        while args.go and not Path(args.go).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        while peer.global_step < args.steps:
            loss = task.loss(model, 8)
            loss.backward()
            time.sleep(0.3)  # compute time: the peers see each other's progress before a step is due
            if peer.step(loss=loss.item()):
                emit(event="state", step=peer.global_step, values=served())
        time.sleep(3.0)  # the last state averaging round and fingerprint settle
        emit(event="state", step=peer.global_step, values=served())
        emit(event="idle", step=peer.global_step)
        while args.until and not Path(args.until).exists():
            time.sleep(0.5)


if __name__ == "__main__":
    main()
