"""Compute utilization of ALBERT-large trainers on shaped links: sync averaging, delayed updates, DiLoCo.

4 peers (``--peers``), each in a network namespace of its own with a ``tbf``-shaped link of ``--rate`` Mbit/s
each way (``lib.netns.Network``). Each peer (``lib/simulated.py``) runs what ``cotrain train`` runs around its
model: cotrain's DHT (the engine's ``SwarmConnection``) and ``cotrain.SwarmPeer`` (hivemind.Optimizer with
cotrain's settings: LAMB offloaded to host memory, fp16 gradient and parameter averaging, state averaging
every step) for the real ALBERT-large model of the ``albert-large-v2`` preset (17.8M parameters), so the
gradient all-reduce, the LAMB step and the state averaging are real.

The GPU's forward and backward passes are SIMULATED: a peer sleeps ``--step-time`` seconds per micro-batch (a
GPU leaves the CPU free while it computes), then calls ``opt.step(batch_size=...)`` as the trainer does.
The default step time, 0.150 s for a micro-batch of 4 sequences of 512 tokens, comes from NVIDIA's BERT-large
pre-training figure on one V100 16 GB with mixed precision (26.64 sequences/s at sequence length 512,
batch 4: DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md, "Pre-training NVIDIA DGX-1 With
16G"); ALBERT-large has BERT-large's 24 layers of width 1024, so the same compute per token.

Utilization is the fraction of a peer's wall time spent on work a GPU peer does on its GPU: the simulated
forward/backward passes, and inside ``opt.step`` the work on the device's tensors (the gradients' norm and
clipping; adding the gradients to hivemind's accumulators in sync and delayed modes; DiLoCo's inner optimizer
step, whose parameters and statistics live on the device). Everything else in ``opt.step`` (waiting for
averaging, sync's LAMB step on its host-memory copy, which a GPU peer also runs on the CPU, and a DiLoCo
round's encoding, decoding and outer step on the host) is not. The sleep alone is reported beside it, and
the time in ``opt.step`` that is not compute, with the part of it in DiLoCo's rounds' ends.
It is measured per peer from the moment it reaches global step ``--warmup-steps`` to the moment it reaches
``--warmup-steps + --steps``, averaged over the peers. Modes, run one after the other on the same links:

- sync: cotrain's defaults (gradients averaged, then the optimizer step, while the trainer waits; state
  averaging in the background);
- delayed: ``--delay-grad-averaging`` (implies ``--delay-optimizer-step``) and ``--delay-state-averaging``:
  the averaging and the optimizer step run in the background while the next micro-batches compute;
- diloco: ``--strategy diloco --local-steps H``: every ``opt.step`` call is an inner LAMB step, and a round
  ends when the swarm has trained ``H x`` the inner batch (``--inner-batch``, default the swarm's samples per
  call, peers x micro-batch x accumulation, so H calls per peer); then the pseudo-gradients are averaged
  while the trainer waits, and the outer step taken;
- diloco-overlap: the same with ``--outer-overlap``: the all-reduce runs during the next round;
- diloco-topk, diloco-topk-overlap: the same two with ``--outer-compression topk`` (sparse rounds).

``--model-params N`` puts a simulated model of N parameters (plain blocks of 1M values, seeded alike on every
peer: ``lib.netns.plain_model``) in place of ALBERT-large, with a plain SGD inner step, for the DiLoCo modes:
a round's traffic, encoding, averaging and outer step are those of a model of that size, while the host's work
per inner step stays what a GPU peer leaves its CPU (an inner LAMB step over N parameters on this machine's
CPU would stand for work a GPU does in milliseconds).

For DiLoCo the global step is the outer round: the window is ``--warmup-rounds`` rounds, then as many rounds
as hold at least the samples of the synchronous window (``--steps x --target-batch-size``), unless
``--rounds`` is given. After its first ``opt.step`` call (in the warm-up) a peer waits until it sees all the
others' progress, so that with a small target batch the first peer does not take steps alone; the peers are
stopped once all have reached the window's end.

    python benchmarks/utilization.py [--rate 100] [--target-batch-size 4096] [--steps 3] [--local-steps 50]
        [--modes sync delayed diloco diloco-overlap] [--quick] [--model-params N]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import netns  # noqa: E402
from lib.netns import CpuSampler, Peers  # noqa: E402
from lib.simulated import ALBERT_LARGE_PARAMS, MODES, V100_STEP_TIME, is_diloco, run_swarm, worker_argv  # noqa: E402

GOAL = 0.90
DILOCO_GOAL = 0.99


def window(mode: str, args) -> tuple[int, int, int]:
    """(first, last global step of the timed window, samples the swarm trains per global step)."""
    if not is_diloco(mode):
        return args.warmup_steps, args.warmup_steps + args.steps, args.target_batch_size
    per_round = args.local_steps * args.inner_batch
    rounds = args.rounds or max(1, math.ceil(args.steps * args.target_batch_size / per_round))
    return args.warmup_rounds, args.warmup_rounds + rounds, per_round


def peer_argv(mode: str, args) -> list[str]:
    """The command line of a peer of ``mode``: it runs one step past the window (``window``)."""
    _, stop_at, _ = window(mode, args)
    batch = args.inner_batch if is_diloco(mode) else args.target_batch_size
    return worker_argv(mode, args, stop_at + 1, batch)


def run_mode(mode: str, args, logdir: Path) -> dict:
    _, stop_at, _ = window(mode, args)
    with netns.Network(args.peers, args.rate) as net:
        samplers: list[CpuSampler] = []

        def start_sampler(peers: Peers) -> None:
            samplers.append(CpuSampler(peers.pids))
            samplers[0].start()

        try:
            marks = run_swarm(net, peer_argv(mode, args), logdir / mode, mode, start_sampler, stop_at)
        except RuntimeError as e:
            print(f"  {mode}: {e}", flush=True)
            return {"mode": mode, "ok": False, "error": str(e)}
        finally:
            for sampler in samplers:
                sampler.stopped.set()
    return summarize(mode, marks, samplers[0], args)


def summarize(mode: str, marks: list[dict[int, dict]], sampler: CpuSampler, args) -> dict:
    a, b, samples = window(mode, args)
    per_peer, windows, failed = [], [], 0
    for m in marks:
        if a not in m or b not in m:
            continue
        wall = m[b]["t"] - m[a]["t"]

        def share(key: str, m=m, wall=wall) -> float:
            return (m[b][key] - m[a][key]) / wall

        sleep, on_device, in_step = share("compute"), share("on_device"), share("in_step")
        per_peer.append((sleep + on_device, sleep, in_step - on_device, share("round_end")))
        windows.append((m[a]["t"], m[b]["t"], wall))
        failed += m[b]["rounds"][1] - m[a]["rounds"][1]
    if not per_peer:
        return {"mode": mode, "ok": False}
    t0, t1 = min(w[0] for w in windows), max(w[1] for w in windows)
    machine, ours = sampler.cores(t0, t1)
    steps = b - a
    step_s = statistics.mean(w[2] for w in windows) / steps
    return {
        "mode": mode,
        "ok": True,
        "window": [a, b],
        "samples_per_step": samples,
        "peers_measured": len(per_peer),
        "utilization": statistics.mean(p[0] for p in per_peer),
        "min_utilization": min(p[0] for p in per_peer),
        "sleep_share": statistics.mean(p[1] for p in per_peer),
        "waiting": statistics.mean(p[2] for p in per_peer),
        "round_end": statistics.mean(p[3] for p in per_peer),
        "failed_rounds": failed,
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
        f"{args.peers} peers, {args.rate:g} Mbit/s links, {model_name(args)}, target batch "
        f"{args.target_batch_size}, micro-batch {args.micro_batch} x {args.accumulation} accumulated, "
        f"simulated compute {args.step_time:.3f} s per micro-batch ({compute:.1f} s per global step); "
        f"diloco: H = {args.local_steps} inner steps of {args.inner_batch} samples (swarm) per round; "
        f"averaging timeout {args.averaging_timeout:g} s"
    )
    print()
    print("| mode | window (global steps) | samples per step | utilization (mean, lowest peer) | sleep only "
          "| waiting in opt.step (of it at rounds' ends) | failed rounds | s per global step "
          "| samples/s (ideal) | cores busy (machine / peers) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["ok"]:
            print(f"| {r['mode']} | no complete window: {r.get('error', '')} | | | | | | | | |")
            continue
        print(
            f"| {r['mode']} | {r['window'][0]}-{r['window'][1]} | {r['samples_per_step']} "
            f"| **{r['utilization']:.1%}**, {r['min_utilization']:.1%} | {r['sleep_share']:.1%} "
            f"| {r['waiting']:.1%} ({r['round_end']:.1%}) | {r['failed_rounds']} "
            f"| {r['seconds_per_step']:.1f} "
            f"| {r['samples_per_s']:.1f} ({r['ideal_samples_per_s']:.1f}) "
            f"| {r['machine']:.2f} / {r['ours']:.2f} |"
        )
    for mode, goal in (("delayed", GOAL), ("diloco-overlap", DILOCO_GOAL)):
        found = [r for r in rows if r["mode"] == mode and r["ok"]]
        if found:
            u = found[0]["utilization"]
            print(f"Goal: >= {goal:.0%} with {mode}: {'met' if u >= goal else 'NOT met'} ({u:.1%})")
    summary = {"rate_mbit": args.rate, "peers": args.peers, "local_steps": args.local_steps, "rows": rows}
    print(json.dumps(summary))


def model_name(args) -> str:
    if args.model_params:
        return f"a simulated model of {args.model_params / 1e6:.0f}M parameters (SGD inner steps)"
    return "ALBERT-large (17.8M parameters)"


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--local-steps", type=int, default=50, help="diloco: inner steps per round (H)")
    ap.add_argument(
        "--inner-batch",
        type=int,
        default=0,
        help="diloco: the swarm's samples per inner step (its target_batch_size; default: peers x "
        "micro-batch x accumulation, so that a round is H opt.step calls per peer)",
    )
    ap.add_argument("--warmup-rounds", type=int, default=1, help="diloco: rounds before the timed window")
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="diloco: rounds timed (default: enough for --steps x --target-batch-size samples)",
    )
    ap.add_argument(
        "--averaging-timeout",
        type=float,
        default=0.0,
        help="s (default: the preset's 60, or 3 x the bound of a DiLoCo round's all-reduce if more)",
    )
    ap.add_argument("--limit", type=float, default=1500.0, help="stop everything after this many seconds")
    ap.add_argument("--keep-logs", action="store_true", help="keep the peers' logs (cotrain's info lines)")
    ap.add_argument(
        "--model-params",
        type=int,
        default=0,
        help="a simulated model of this many parameters in plain blocks, with SGD inner steps, in place of "
        "ALBERT-large (for the DiLoCo modes: sync's LAMB state averaging needs the real model)",
    )
    ap.add_argument("--quick", action="store_true", help="target batch 1024, 2 timed steps, H = 10")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.target_batch_size, args.steps, args.local_steps = 1024, 2, 10
    if not args.inner_batch:
        args.inner_batch = args.peers * args.micro_batch * args.accumulation
    if not args.averaging_timeout:
        # the largest all-reduce: a DiLoCo round that carries the outer state (the first) averages 3 fp16
        # vectors (change, global parameters, momentum)
        params = args.model_params or ALBERT_LARGE_PARAMS
        bound = netns.allreduce_bound_s(args.peers, 3 * 2 * params, args.rate * 1e6)
        args.averaging_timeout = float(max(60, math.ceil(3 * bound)))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    netns.prepare_namespaces("utilization.py", args.limit)
    started = netns.print_started()
    rows = []
    with netns.logs_folder("cotrain-utilization-", args.keep_logs) as tmp:
        for mode in args.modes:
            rows.append(run_mode(mode, args, tmp))
            print(f"  {mode}: {json.dumps(rows[-1])}", flush=True)
    print_table(rows, args)
    netns.print_finished(started)


if __name__ == "__main__":
    main()
