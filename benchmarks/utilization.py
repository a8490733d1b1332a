"""Compute utilization of ALBERT-large trainers on shaped links: synchronous averaging vs delayed updates.

4 peers (``--peers``), each in a network namespace of its own with a ``tbf``-shaped link of ``--rate`` Mbit/s
each way (``_netns.Network``). Each peer runs what ``cotrain train`` runs around its model: cotrain's DHT
(the engine's ``SwarmConnection``) and ``cotrain.SwarmPeer``
(hivemind.Optimizer with cotrain's settings: LAMB offloaded to host memory, fp16 gradient and parameter
averaging, state averaging every step) for the real ALBERT-large model of the ``albert-large-v2`` preset
(17.8M parameters), so the gradient all-reduce, the LAMB step and the state averaging are real.

The GPU's forward and backward passes are SIMULATED: a peer sleeps ``--step-time`` seconds per micro-batch (a
GPU leaves the CPU free while it computes), then calls ``opt.step(batch_size=...)`` as the trainer does.
The default step time, 0.150 s for a micro-batch of 4 sequences of 512 tokens, comes from NVIDIA's BERT-large
pre-training figure on one V100 16 GB with mixed precision (26.64 sequences/s at sequence length 512,
batch 4: DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md, "Pre-training NVIDIA DGX-1 With
16G"); ALBERT-large has BERT-large's 24 layers of width 1024, so the same compute per token.

Utilization is the fraction of a peer's wall time spent in the (simulated) compute, measured per peer from
the moment it reaches global step ``--warmup-steps`` to the moment it reaches ``--warmup-steps + --steps``,
averaged over the peers. Modes, run one after the other on the same links:

- sync: cotrain's defaults (gradients averaged, then the optimizer step, while the trainer waits; state
  averaging in the background);
- delayed: ``--delay-grad-averaging`` (implies ``--delay-optimizer-step``) and ``--delay-state-averaging``:
  the averaging and the optimizer step run in the background while the next micro-batches compute.

    python benchmarks/utilization.py [--target-batch-size 4096] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _netns  # noqa: E402
from _netns import CpuSampler, Peers, say  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.90
V100_STEP_TIME = 4 / 26.64  # s per micro-batch of 4 x 512 tokens (see the module's docstring)
MODES = {
    "sync": {"delay_grad_averaging": False, "delay_optimizer_step": False, "delay_state_averaging": True},
    "delayed": {"delay_grad_averaging": True, "delay_optimizer_step": True, "delay_state_averaging": True},
}


# ----------------------------------------------------------------------------------------------- peer process


def peer_main(args: argparse.Namespace) -> None:
    import torch

    from cotrain.config import resolve
    from cotrain.engine import SwarmConnection, SwarmPeer
    from cotrain.models import build_model, optimizer_factory, parameter_groups, scheduler_factory

    torch.set_num_threads(1)
    config = resolve(
        "albert-large-v2",
        overrides={
            "run": {
                "run_id": f"util-{args.mode}",
                "target_batch_size": args.target_batch_size,
            },
            "peer": {
                "matchmaking_time": args.matchmaking_time,
                "host_maddrs": [f"/ip4/{args.address}/tcp/0"],
                "initial_peers": [args.initial_peer] if args.initial_peer else [],
                "per_device_train_batch_size": args.micro_batch,
                "gradient_accumulation_steps": args.accumulation,
                **MODES[args.mode],
            },
        },
    )
    run, peer = config.run, config.peer
    connection = SwarmConnection(run.run_id, peer, role="trainer")
    say(maddrs=connection.maddrs())
    model = build_model(run, vocab_size=30000)
    samples = peer.per_device_train_batch_size * peer.gradient_accumulation_steps
    swarm = SwarmPeer.from_config(
        run,
        peer,
        model,
        connection=connection,
        params=parameter_groups(model, run.weight_decay),
        optimizer=optimizer_factory(run),
        scheduler=scheduler_factory(run),
        batch_size_per_step=samples,
    )
    gen = torch.Generator().manual_seed(args.index)
    for p in model.parameters():  # gradients as a backward pass would leave them (kept: no zero_grad)
        p.grad = torch.randn(p.shape, generator=gen) * 1e-4
    say(ready=True)
    sys.stdin.readline()  # all peers start computing together
    compute = in_step = 0.0
    epoch = swarm.global_step
    deadline = time.monotonic() + args.peer_limit
    while epoch < args.stop_at and time.monotonic() < deadline:
        t0 = time.perf_counter()
        time.sleep(args.step_time * peer.gradient_accumulation_steps)  # the simulated forward/backward
        t1 = time.perf_counter()
        swarm.step(batch_size=samples, zero_grad=False)
        t2 = time.perf_counter()
        compute, in_step = compute + (t1 - t0), in_step + (t2 - t1)
        if swarm.global_step != epoch:
            epoch = swarm.global_step
            say(epoch=epoch, t=time.monotonic(), compute=compute, in_step=in_step)
    say(done=epoch)
    swarm.shutdown()


# ------------------------------------------------------------------------------------------- orchestration


def run_mode(mode: str, args, logdir: Path) -> dict:
    stop_at = args.warmup_steps + args.steps
    with _netns.Network(args.peers, args.rate) as net:
        worker = [
            sys.executable, str(Path(__file__).resolve()), "--peer", "--mode", mode,
            "--target-batch-size", str(args.target_batch_size),
            "--matchmaking-time", str(args.matchmaking_time),
            "--micro-batch", str(args.micro_batch), "--accumulation", str(args.accumulation),
            "--step-time", str(args.step_time), "--stop-at", str(stop_at), "--peer-limit", str(args.limit),
        ]  # fmt: skip
        peers = Peers(net, worker, logdir / mode, cwd=REPO)
        peers.logdir.mkdir(parents=True, exist_ok=True)
        sampler = CpuSampler(peers.pids)
        marks: list[dict[int, dict]] = [{} for _ in range(args.peers)]
        try:
            peers.start(0, [])
            first = peers.receive(0, 300)["maddrs"][0]
            for i in range(1, args.peers):
                peers.start(i, ["--initial-peer", first])
            for i in range(1, args.peers):
                peers.receive(i, 300)
            for i in range(args.peers):
                peers.receive(i, 300)  # ready
            peers.send({"op": "go"})
            sampler.start()
            started = time.monotonic()
            done = set()
            while len(done) < args.peers:
                for i in range(args.peers):
                    if i in done:
                        continue
                    try:
                        msg = peers.receive(i, 0.2)
                    except RuntimeError as e:
                        if "did not answer" in str(e):
                            continue
                        raise
                    if "epoch" in msg:
                        marks[i][msg["epoch"]] = msg
                        print(f"  {mode}: peer {i} reached step {msg['epoch']} "
                              f"at {msg['t'] - started:.0f} s", flush=True)  # fmt: skip
                    elif "done" in msg:
                        done.add(i)
        finally:
            sampler.stopped.set()
            peers.stop()
    return summarize(mode, marks, sampler, args)


def summarize(mode: str, marks: list[dict[int, dict]], sampler: CpuSampler, args) -> dict:
    a, b = args.warmup_steps, args.warmup_steps + args.steps
    per_peer, windows = [], []
    for m in marks:
        if a not in m or b not in m:
            continue
        wall = m[b]["t"] - m[a]["t"]
        per_peer.append(
            ((m[b]["compute"] - m[a]["compute"]) / wall, (m[b]["in_step"] - m[a]["in_step"]) / wall)
        )
        windows.append((m[a]["t"], m[b]["t"], wall))
    if not per_peer:
        return {"mode": mode, "ok": False}
    t0, t1 = min(w[0] for w in windows), max(w[1] for w in windows)
    machine, ours = sampler.cores(t0, t1)
    step_s = statistics.mean(w[2] for w in windows) / args.steps
    samples = args.target_batch_size
    return {
        "mode": mode,
        "ok": True,
        "peers_measured": len(per_peer),
        "utilization": statistics.mean(u for u, _ in per_peer),
        "min_utilization": min(u for u, _ in per_peer),
        "in_step": statistics.mean(s for _, s in per_peer),
        "seconds_per_step": step_s,
        "samples_per_s": samples / step_s,
        "ideal_samples_per_s": args.peers * args.micro_batch / args.step_time,
        "machine": machine,
        "ours": ours,
    }


def print_table(rows: list[dict], args) -> None:
    compute = args.target_batch_size / (args.peers * args.micro_batch) * args.step_time
    print()
    print(
        f"{args.peers} peers, {args.rate:g} Mbit/s links, ALBERT-large (17.8M parameters), target batch "
        f"{args.target_batch_size}, micro-batch {args.micro_batch} x {args.accumulation} accumulated, "
        f"simulated compute {args.step_time:.3f} s per micro-batch ({compute:.1f} s per global step)"
    )
    print()
    print("| mode | utilization (mean, lowest peer) | in opt.step | s per global step | target / step s "
          "(ideal) | cores busy (machine / peers) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        if not r["ok"]:
            print(f"| {r['mode']} | no complete window | | | | |")
            continue
        print(
            f"| {r['mode']} | **{r['utilization']:.1%}**, {r['min_utilization']:.1%} | {r['in_step']:.1%} "
            f"| {r['seconds_per_step']:.1f} | {r['samples_per_s']:.1f} ({r['ideal_samples_per_s']:.1f}) "
            f"| {r['machine']:.2f} / {r['ours']:.2f} |"
        )
    delayed = [r for r in rows if r["mode"] == "delayed" and r["ok"]]
    if delayed:
        u = delayed[0]["utilization"]
        print(f"\nGoal: >= {GOAL:.0%} with delayed updates: {'met' if u >= GOAL else 'NOT met'} ({u:.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s each way")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--target-batch-size", type=int, default=4096, help="as in the albert-large-v2 preset")
    ap.add_argument("--micro-batch", type=int, default=4, help="per-device batch (the preset's)")
    ap.add_argument("--accumulation", type=int, default=8, help="micro-batches per opt.step call")
    ap.add_argument("--step-time", type=float, default=V100_STEP_TIME, help="simulated s per micro-batch")
    ap.add_argument("--matchmaking-time", type=float, default=5.0, help="as in the albert-large-v2 preset")
    ap.add_argument("--warmup-steps", type=int, default=1, help="global steps before the timed window")
    ap.add_argument("--steps", type=int, default=3, help="global steps timed")
    ap.add_argument("--limit", type=float, default=1500.0, help="stop everything after this many seconds")
    ap.add_argument("--quick", action="store_true", help="target batch 1024, 2 timed steps")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--peer-limit", type=float, default=1500.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        return peer_main(args)
    if args.quick:
        args.target_batch_size, args.steps = 1024, 2
    _netns.prepare_namespaces("utilization.py", args.limit)
    started = _netns.print_started()
    tmp = Path(tempfile.mkdtemp(prefix="cotrain-utilization-"))
    rows = []
    try:
        for mode in args.modes:
            rows.append(run_mode(mode, args, tmp))
    except BaseException:
        print(f"peers' logs kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, args)
    _netns.print_finished(started)


if __name__ == "__main__":
    main()
