"""Compute utilization of ALBERT-large trainers on shaped links: sync averaging, delayed updates, DiLoCo.

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
peer: ``_netns.plain_model``) in place of ALBERT-large, with a plain SGD inner step, for the DiLoCo modes: a
round's traffic, encoding, averaging and outer step are those of a model of that size, while the host's work
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
import logging
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _netns  # noqa: E402
from _netns import CpuSampler, Peers, fixed_gradients, plain_model, say, simulated_peer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOAL = 0.90
DILOCO_GOAL = 0.99
ALBERT_LARGE_PARAMS = 17_847_474
V100_STEP_TIME = 4 / 26.64  # s per micro-batch of 4 x 512 tokens (see the module's docstring)
SYNC_DEFAULTS = {"delay_grad_averaging": False, "delay_optimizer_step": False, "delay_state_averaging": True}
MODES = {  # mode: (run settings, peer settings)
    "sync": ({}, SYNC_DEFAULTS),
    "delayed": ({}, dict.fromkeys(SYNC_DEFAULTS, True)),
    "diloco": ({"strategy": "diloco", "outer_overlap": False}, SYNC_DEFAULTS),
    "diloco-overlap": ({"strategy": "diloco", "outer_overlap": True}, SYNC_DEFAULTS),
    "diloco-topk": (
        {"strategy": "diloco", "outer_overlap": False, "outer_compression": "topk"},
        SYNC_DEFAULTS,
    ),
    "diloco-topk-overlap": (
        {"strategy": "diloco", "outer_overlap": True, "outer_compression": "topk"},
        SYNC_DEFAULTS,
    ),
}


def is_diloco(mode: str) -> bool:
    return MODES[mode][0].get("strategy") == "diloco"


def timed(fn, total: list[float]):
    """``fn`` that adds the seconds each call takes to ``total[0]``."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0

    return wrapper


# ----------------------------------------------------------------------------------------------- peer process


def peer_main(args: argparse.Namespace) -> None:
    import torch

    import cotrain.engine.peer as engine_peer
    from cotrain.config import resolve
    from cotrain.engine import SwarmConnection
    from cotrain.models import build_model

    torch.set_num_threads(1)
    if args.keep_logs:  # cotrain's info lines (rounds, partial all-reduces) in the peer's log
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("cotrain").setLevel(logging.INFO)
    run_settings, peer_settings = MODES[args.mode]
    if is_diloco(args.mode):
        run_settings = {**run_settings, "local_steps": args.local_steps}
    config = resolve(
        "albert-large-v2",
        overrides={
            "run": {
                "run_id": f"util-{args.mode}",
                "target_batch_size": args.target_batch_size,
                **run_settings,
            },
            "peer": {
                "matchmaking_time": args.matchmaking_time,
                "averaging_timeout": args.averaging_timeout,
                "host_maddrs": [f"/ip4/{args.address}/tcp/0"],
                "initial_peers": [args.initial_peer] if args.initial_peer else [],
                "per_device_train_batch_size": args.micro_batch,
                "gradient_accumulation_steps": args.accumulation,
                "client_mode": args.client_mode,
                **peer_settings,
            },
        },
    )
    run, peer = config.run, config.peer
    connection = SwarmConnection(run.run_id, peer, role="monitor" if args.aux else "trainer")
    say(maddrs=connection.maddrs())
    if args.model_params:  # a simulated model of that size, with a plain SGD inner step (module's doc)
        model = plain_model(args.model_params)
        inner = lambda params: torch.optim.SGD(params, lr=1e-3)  # noqa: E731
    else:
        model, inner = build_model(run, vocab_size=30000), None
    if args.aux:
        return reducer_main(args, connection, run, peer, model)
    samples = peer.per_device_train_batch_size * peer.gradient_accumulation_steps
    swarm = simulated_peer(run, peer, model, connection, optimizer=inner)
    fixed_gradients(model, args.index)
    on_device = [0.0]  # seconds inside opt.step on work a GPU peer does on its GPU (see the module's doc)
    opt = swarm.strategy.opt
    # the gradients' norm and clipping at every call: a GPU peer computes them on its GPU
    engine_peer.gradient_norm = timed(engine_peer.gradient_norm, on_device)
    round_end = [0.0]  # seconds inside opt.step in DiLoCo's round ends (on the training thread)
    if swarm.strategy.name == "diloco":
        opt.inner_optimizer.step = timed(opt.inner_optimizer.step, on_device)
        opt.outer_round = timed(opt.outer_round, round_end)
    else:
        opt.grad_averager.accumulate_grads_ = timed(opt.grad_averager.accumulate_grads_, on_device)
    say(ready=True)
    sys.stdin.readline()  # all peers start computing together
    quit_ = threading.Event()  # the benchmark's "quit": leave the loop and shut down in order

    def watch_stdin() -> None:
        for line in sys.stdin:
            if "quit" in line:
                break
        quit_.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    compute = in_step = 0.0
    trained = 0  # samples given to opt.step
    epoch = swarm.global_step
    deadline = time.monotonic() + args.peer_limit
    while epoch < args.stop_at and time.monotonic() < deadline and not quit_.is_set():
        t0 = time.perf_counter()
        time.sleep(args.step_time * peer.gradient_accumulation_steps)  # the simulated forward/backward
        t1 = time.perf_counter()
        swarm.step(batch_size=samples, zero_grad=False)
        t2 = time.perf_counter()
        compute, in_step, trained = compute + (t1 - t0), in_step + (t2 - t1), trained + samples
        if trained == samples:  # a peer is seen once it reports samples: wait to see all before going on
            wait_until = time.monotonic() + 120  # (else with a small target the first takes steps alone)
            while (
                swarm.num_peers < args.expect_peers and time.monotonic() < wait_until and not quit_.is_set()
            ):
                time.sleep(0.2)
        if swarm.global_step != epoch:
            epoch = swarm.global_step
            say(
                epoch=epoch,
                t=time.monotonic(),
                compute=compute,
                in_step=in_step,
                on_device=on_device[0],
                round_end=round_end[0],
                rounds=[swarm.strategy.progress.rounds_averaged, swarm.strategy.progress.rounds_failed],
                samples=trained,
                bytes_sent=getattr(opt, "bytes_sent", 0),  # diloco: the engine's count of its payload
                round_bytes=swarm.strategy.progress.round_bytes,
            )
    say(done=epoch)
    swarm.shutdown()


def reducer_main(args: argparse.Namespace, connection, run, peer, model) -> None:
    """A public peer that trains nothing and reduces the others' parts as an auxiliary peer, as the monitor
    does (the strategy's own reducer); at "quit" it says how many rounds it reduced and failed."""
    from cotrain.registry import strategy_class

    reducer = strategy_class(run.strategy).reducer(connection.dht, run, peer, model)
    reducer.start()
    say(ready=True)
    for line in sys.stdin:
        if "quit" in line:
            break
    say(reduced=list(reducer.rounds))
    reducer.close()
    connection.close()


# ------------------------------------------------------------------------------------------- orchestration


def window(mode: str, args) -> tuple[int, int, int]:
    """(first, last global step of the timed window, samples the swarm trains per global step)."""
    if not is_diloco(mode):
        return args.warmup_steps, args.warmup_steps + args.steps, args.target_batch_size
    per_round = args.local_steps * args.inner_batch
    rounds = args.rounds or max(1, math.ceil(args.steps * args.target_batch_size / per_round))
    return args.warmup_rounds, args.warmup_rounds + rounds, per_round


def worker_argv(mode: str, args, stop_at: int, target_batch_size: int) -> list[str]:
    """The command line of a peer process (this script with ``--peer``)."""
    return [
        sys.executable, str(Path(__file__).resolve()), "--peer", "--mode", mode,
        "--target-batch-size", str(target_batch_size), "--local-steps", str(args.local_steps),
        "--averaging-timeout", str(args.averaging_timeout),
        "--matchmaking-time", str(args.matchmaking_time),
        "--micro-batch", str(args.micro_batch), "--accumulation", str(args.accumulation),
        "--step-time", str(args.step_time), "--stop-at", str(stop_at), "--peer-limit", str(args.limit),
        "--expect-peers", str(args.peers), "--model-params", str(args.model_params),
        *(["--keep-logs"] if args.keep_logs else []),
    ]  # fmt: skip


def run_swarm(
    net: _netns.Network,
    worker: list[str],
    logdir: Path,
    label: str,
    on_go: Callable[[Peers], None],
    until: int,
) -> list[dict[int, dict]]:
    """Start a peer per host of ``net``, all joined to the first, start them together (``on_go`` is called
    then), and collect each peer's messages at its global steps until every peer has reached step ``until``
    (the peers run one step further: one that stopped at ``until`` would leave the others to finish their
    step without it): marks[i][step] = peer i's message when it reached ``step``."""
    n = net.hosts
    peers = Peers(net, worker, logdir, cwd=REPO)
    peers.logdir.mkdir(parents=True, exist_ok=True)
    try:
        peers.start(0, [])
        first = peers.receive(0, 300)["maddrs"][0]
        for i in range(1, n):
            peers.start(i, ["--initial-peer", first])
        for i in range(1, n):
            peers.receive(i, 300)
        for i in range(n):
            peers.receive(i, 300)  # ready
        peers.send({"op": "go"})
        on_go(peers)
        net.remember_pids()  # every peer's processes run now
        found = collect_marks(peers, list(range(n)), until, label)
        marks = [found[i] for i in range(n)]
    finally:
        net.remember_pids()
        peers.stop()
    return marks


def collect_marks(peers: Peers, which: list[int], until: int, label: str) -> dict[int, dict[int, dict]]:
    """Peer i's messages at its global steps, for each i in ``which``, until each has reached step ``until``
    (or said it is done): marks[i][step]."""
    marks: dict[int, dict[int, dict]] = {i: {} for i in which}
    started, done = time.monotonic(), set()
    while len(done) < len(which):
        for i in which:
            if i in done:
                continue
            if until in marks[i]:
                done.add(i)
                continue
            try:
                msg = peers.receive(i, 0.2)
            except RuntimeError as e:
                if "did not answer" not in str(e):
                    raise
                code = peers.procs[i].poll()  # its stdout may stay open in an orphaned child
                if code is not None:
                    cause = " (SIGKILL: out of memory?)" if code == -9 else ""
                    raise RuntimeError(f"peer {i} exited with code {code}{cause}; see {peers.logdir}") from e
                continue
            if "epoch" in msg:
                marks[i][msg["epoch"]] = msg
                print(f"  {label}: peer {i} reached step {msg['epoch']} "
                      f"at {msg['t'] - started:.0f} s", flush=True)  # fmt: skip
            elif "done" in msg:
                done.add(i)
    return marks


def run_mode(mode: str, args, logdir: Path) -> dict:
    _, stop_at, _ = window(mode, args)
    batch = args.inner_batch if is_diloco(mode) else args.target_batch_size
    with _netns.Network(args.peers, args.rate) as net:
        samplers: list[CpuSampler] = []

        def start_sampler(peers: Peers) -> None:
            samplers.append(CpuSampler(peers.pids))
            samplers[0].start()

        try:
            worker = worker_argv(mode, args, stop_at + 1, batch)
            marks = run_swarm(net, worker, logdir / mode, mode, start_sampler, stop_at)
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
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--peer-limit", type=float, default=1500.0, help=argparse.SUPPRESS)
    ap.add_argument("--expect-peers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--client-mode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--aux", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.target_batch_size, args.steps, args.local_steps = 1024, 2, 10
    if not args.inner_batch:
        args.inner_batch = args.peers * args.micro_batch * args.accumulation
    if not args.averaging_timeout and not args.peer:
        # the largest all-reduce: a DiLoCo round that carries the outer state (the first) averages 3 fp16
        # vectors (change, global parameters, momentum)
        params = args.model_params or ALBERT_LARGE_PARAMS
        bound = _netns.allreduce_bound_s(args.peers, 3 * 2 * params, args.rate * 1e6)
        args.averaging_timeout = float(max(60, math.ceil(3 * bound)))
    if args.peer:
        return peer_main(args)
    _netns.prepare_namespaces("utilization.py", args.limit)
    started = _netns.print_started()
    rows = []
    with _netns.logs_folder("cotrain-utilization-", args.keep_logs) as tmp:
        for mode in args.modes:
            rows.append(run_mode(mode, args, tmp))
            print(f"  {mode}: {json.dumps(rows[-1])}", flush=True)
    print_table(rows, args)
    _netns.print_finished(started)


if __name__ == "__main__":
    main()
