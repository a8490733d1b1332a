"""A DiLoCo peer for the live tests: cotrain.SwarmPeer with --strategy diloco on a small regression model.

Each peer fits the same linear map from data of its own seed with AdamW (the inner optimizer). It records,
for every outer round, what went into the all-reduce (its own pseudo-gradient and weight), what came out (the
average and the group's size), and the global parameters and outer momentum before and after the outer step,
as JSON lines in --out, so a test can recompute the outer step from the peers' own changes.

    python tests/diloco_peer.py --out a.jsonl --rounds 3 [--initial-peers ADDR] [--client-mode]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import cotrain
from peer_task import DIM, INIT_SEED, Task, flat, jsonl, peer_arguments


def main() -> None:
    p = peer_arguments(target_batch_size=16, step_sleep=0.05, run_id="diloco-test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--client-mode", action="store_true")
    p.add_argument("--local-steps", type=int, default=12)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--outer-lr", type=float, default=None, help="default: the API's (by compression)")
    p.add_argument("--outer-momentum", type=float, default=None)
    p.add_argument("--averaging-timeout", type=float, default=15.0)
    p.add_argument("--outer-compression", default="dense")
    p.add_argument("--width", type=int, default=0, help="a hidden layer of this width (0: none)")
    p.add_argument("--lr", type=float, default=0.05, help="the inner AdamW's learning rate")
    p.add_argument(
        "--late-when", default=None, help="once this file exists, a step lasts until the round ends"
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(INIT_SEED)
    model = torch.nn.Linear(DIM, 1)
    if args.width:  # enough parameters for chunks of sparse records to leave values out
        model = torch.nn.Sequential(torch.nn.Linear(DIM, args.width), torch.nn.Linear(args.width, 1))
    task, (emit, close) = Task(args.seed), jsonl(args.out)

    peer = cotrain.SwarmPeer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        initial_peers=args.initial_peers,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        client_mode=args.client_mode,
        batch_size_per_step=args.batch,
        matchmaking_time=2.0,
        averaging_timeout=args.averaging_timeout,
        load_state_timeout=30.0,
        startup_timeout=30.0,
        strategy="diloco",
        local_steps=args.local_steps,
        outer_overlap=args.overlap,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_compression=args.outer_compression,
        torch_threads=1,
    )
    opt = peer.strategy.opt
    average, outer_step = opt._average, opt._outer_step

    def recorded_average(own, sent, weight):
        began = time.time()
        with opt.state_averager.lock_averaged_tensors:
            mine = flat(opt.state_averager.global_parameters)
        lineage = opt.lineage.hex()
        averaged, base, size = average(own, sent, weight)
        row = {"own": flat(own), "weight": weight, "averaged": flat(averaged), "size": size, "global": mine}
        # the lineage sent at matchmaking and the one after; whether the group averaged the outer state too
        # dense rounds average the outer state in place (base None): the global parameters are the average
        carried = base is not None or (size > 1 and opt.last_carried_state)
        row.update(lineage_before=lineage, lineage=opt.lineage.hex(), carried=carried)
        row["partial"] = opt.last_round_partial and size > 1
        if carried:  # the group's average outer state: global parameters, then momentum
            with opt.state_averager.lock_averaged_tensors:
                glob = opt.state_averager.global_parameters if base is None else base[: len(opt.parameters)]
                row["averaged_global"] = flat(glob)
        emit(event="average", round=opt.local_epoch, began=began, ended=time.time(), **row)
        return averaged, base, size

    def recorded_outer_step(averaged, base):
        sa = opt.state_averager
        n = len(sa.global_parameters)
        before = flat(base[:n]) if base is not None else flat(sa.global_parameters)
        momentum = opt.state_averager.outer_state()[n:]  # zeros where SGD keeps no buffer (momentum 0)
        momentum_before = flat(base[n:]) if base is not None and len(base) > n else flat(momentum)
        outer_step(averaged, base)
        momentum = opt.state_averager.outer_state()[n:]
        emit(
            event="outer",
            round=opt.local_epoch,
            before=before,
            after=flat(sa.global_parameters),
            momentum_before=momentum_before,
            momentum=flat(momentum),
            applied=flat(averaged),
            size=opt.last_group_size,
            partial=opt.last_round_partial,
        )

    averaged_from = opt._averaged

    def recorded_averaged(gathered, partial, *received):
        """Every all-reduce that ended (overlapped rounds included): what the group sent, what it carried."""
        lineage = opt.lineage.hex()
        out = averaged_from(gathered, partial, *received)
        sent = sorted((v.get("round"), v.get("lineage", b"").hex()) for v in gathered.values())
        row = dict(round=opt.local_epoch, sent=sent, carried=opt.last_carried_state, partial=partial)
        emit(event="averaged", **row, lineage_before=lineage, lineage=opt.lineage.hex(), size=out[2])
        return out

    opt._average, opt._outer_step, opt._averaged = recorded_average, recorded_outer_step, recorded_averaged
    with peer:
        # a latecomer has downloaded the state by now, in the lineage its donor vouched for (if any)
        ready = dict(maddrs=peer.maddrs, step=peer.global_step, peer_id=peer.peer_id)
        emit(event="ready", **ready, lineage=opt.lineage.hex())
        print(json.dumps({"event": "ready", "maddrs": peer.maddrs}), flush=True)
        start, late = peer.global_step, args.late_when
        while peer.global_step < start + args.rounds or (args.until and not Path(args.until).exists()):
            loss = task.loss(model, args.batch)
            loss.backward()
            time.sleep(args.step_sleep)
            if late and opt.inner_steps_this_round > 0 and Path(late).exists():  # a slow step, once
                round_, late = opt.local_epoch, None
                emit(event="late", round=round_)
                deadline = time.monotonic() + 120
                while not opt.tracker.passed_by(round_) and time.monotonic() < deadline:
                    time.sleep(0.1)
            if peer.step(loss=loss.item()):
                emit(event="step", **peer.last_report)
        # the round's all-reduce streams this peer opened directly and over libp2p, and served directly
        transport = opt.outer_averager.transport_counts()
    emit(event="done", step=peer.global_step, transport=transport)
    close()
    sys.exit(0)


if __name__ == "__main__":
    main()
