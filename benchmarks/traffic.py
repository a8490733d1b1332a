"""Bytes on the wire per trained sample: synchronous averaging against DiLoCo with H = 10, 50 and 100.

4 peers (``--peers``), each in a network namespace of its own with a ``tbf``-shaped link of ``--rate`` Mbit/s
each way (``lib.netns.Network``), run the simulated peers of ``lib/simulated.py``: cotrain's DHT and
``cotrain.SwarmPeer`` for the real ALBERT-large model of the ``albert-large-v2`` preset (17.8M parameters,
fp16 on the wire), with the forward and backward passes simulated by a sleep of ``--step-time`` s per
micro-batch. Configurations, one after the other on the same links, all with the same swarm batch
``--target-batch-size`` (sync: samples per global step; DiLoCo: samples per inner step, so a round is H x
that):

- sync: cotrain's defaults (gradients averaged at every global step, parameters averaged in the background
  at every step);
- diloco H: ``--strategy diloco --local-steps H`` for each H of ``--local-steps`` (pseudo-gradients averaged
  once per round);
- with ``--topk``, diloco-topk H: the same with ``--outer-compression topk`` (sparse rounds), beside each.

The traffic is read from the links' own counters: the byte counters of each host's veth (``v<i>`` on the
bridge: Ethernet frames, so TCP/IP headers, acknowledgements, libp2p framing, the DHT and the progress
tracker's records all count), sampled 20 times a second. The window runs from the moment the first peer
reaches global step ``--warmup`` (an untimed warm-up step or round) to the moment the last peer reaches the
window's end; the samples are those the peers gave to ``opt.step`` between their own marks. Bytes per
sample = bytes all hosts sent / samples all peers trained; also given per sample of the target (a sync
step's batch, a round's H x batch), which leaves out how far steps overshoot their target. Beside it for
DiLoCo, the engine's own count (``DiLoCoOptimizer.bytes_sent``: payload from the tensor sizes and the
compression) and its metric ``round_bytes`` (a peer's payload in its last round), against the bytes each
host sent per round.

    python benchmarks/traffic.py [--rate 100] [--local-steps 10 50 100] [--topk] [--quick]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import netns  # noqa: E402
from lib.netns import LinkCounters  # noqa: E402
from lib.simulated import ALBERT_LARGE_PARAMS, is_diloco, run_swarm, worker_argv  # noqa: E402


def peer_argv(mode: str, local_steps: int, timed: int, args) -> list[str]:
    """The command line of a peer of one configuration: it runs one step or round past the window."""
    peer_args = argparse.Namespace(**{**vars(args), "local_steps": local_steps})
    return worker_argv(mode, peer_args, args.warmup + timed + 1, args.target_batch_size)


def configs(args) -> list[tuple[str, str, int, int]]:
    """(name, mode, H, steps or rounds timed) of each configuration, in the order they run."""
    out = [] if args.no_sync else [("sync", "sync", args.local_steps[0], args.steps)]
    for h in args.local_steps:
        if not (args.no_dense and args.topk):
            out.append((f"diloco H={h}", "diloco", h, args.rounds))
        if args.topk:
            out.append((f"diloco-topk H={h}", "diloco-topk", h, args.rounds))
    return out


def run_config(name: str, mode: str, local_steps: int, timed: int, args, logdir: Path) -> dict:
    """Run one configuration; ``timed`` global steps (sync) or rounds (diloco) after the warm-up."""
    a, b = args.warmup, args.warmup + timed
    with netns.Network(args.peers, args.rate) as net:
        counters = LinkCounters(net)
        try:
            worker = peer_argv(mode, local_steps, timed, args)
            marks = run_swarm(net, worker, logdir / name, name, lambda peers: None, b)
        except RuntimeError as e:
            print(f"  {name}: {e}", flush=True)
            return {"config": name, "ok": False, "error": str(e)}
        finally:
            counters.close()
    complete = [m for m in marks if a in m and b in m]
    if len(complete) < len(marks):
        return {"config": name, "ok": False}
    t0, t1 = min(m[a]["t"] for m in complete), max(m[b]["t"] for m in complete)
    links = counters.between(t0, t1)
    if not links:
        return {"config": name, "ok": False}
    sent = sum(s for s, _ in links)
    samples = sum(m[b]["samples"] - m[a]["samples"] for m in complete)
    engine = sum(m[b]["bytes_sent"] - m[a]["bytes_sent"] for m in complete)
    return {
        "config": name,
        "ok": True,
        "local_steps": local_steps if is_diloco(mode) else None,
        "window": [a, b],
        "seconds": t1 - t0,
        "samples": samples,
        "samples_per_step": samples / timed,
        "bytes_sent": sent,
        "bytes_received": sum(r for _, r in links),
        "bytes_per_sample": sent / samples,
        # per sample of the target (a sync step's batch, a round's H x batch): without the steps' overshoot
        "bytes_per_target_sample": sent
        / (timed * args.target_batch_size * (local_steps if is_diloco(mode) else 1)),
        "sent_per_peer_per_step": sent / len(links) / timed,
        "received_per_peer_per_step": sum(r for _, r in links) / len(links) / timed,
        "engine_bytes_per_sample": engine / samples if is_diloco(mode) else None,
        "round_bytes": (statistics.mean(m[b]["round_bytes"] for m in complete) if is_diloco(mode) else None),
        "failed_rounds": sum(m[b]["rounds"][1] - m[a]["rounds"][1] for m in complete),
    }


def print_table(rows: list[dict], args) -> None:
    payload = 2 * ALBERT_LARGE_PARAMS  # fp16
    share = 2 * (args.peers - 1) / args.peers
    print()
    print(
        f"{args.peers} peers, {args.rate:g} Mbit/s links, ALBERT-large (17.8M parameters, "
        f"{payload / 1e6:.1f} MB in fp16), swarm batch {args.target_batch_size} per sync step / DiLoCo inner "
        f"step, simulated compute "
        f"{args.step_time:.3f} s per micro-batch of {args.micro_batch} x {args.accumulation} accumulated; "
        f"a full all-reduce sends {share * payload / 1e6:.1f} MB of payload per peer"
    )
    print()
    print("| config | window (steps) | samples trained (per step) | bytes sent, all links | bytes per sample "
          "| vs sync | goal (>= H/2) | vs sync, per target sample "
          "| per peer per step: sent (engine's round_bytes), received "
          "| engine's bytes per sample | failed rounds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sync = next((r for r in rows if r["config"] == "sync" and r["ok"]), None)
    for r in rows:
        if not r["ok"]:
            print(f"| {r['config']} | no complete window: {r.get('error', '')} | | | | | | | | | |")
            continue
        ratio = sync["bytes_per_sample"] / r["bytes_per_sample"] if sync else float("nan")
        r["less_than_sync"] = ratio
        per_target = sync["bytes_per_target_sample"] / r["bytes_per_target_sample"] if sync else float("nan")
        r["less_than_sync_per_target_sample"] = per_target
        goal = "- (no sync arm)" if sync is None and r["local_steps"] else ""
        if r["local_steps"] and sync is not None:
            r["goal_met"] = ratio >= r["local_steps"] / 2
            goal = f"{'met' if r['goal_met'] else 'NOT met'} ({r['local_steps'] / 2:g}x)"
        engine = f"{r['engine_bytes_per_sample']:,.0f}" if r["engine_bytes_per_sample"] is not None else "-"
        round_bytes = f" ({r['round_bytes'] / 1e6:.2f} MB)" if r["round_bytes"] is not None else ""
        print(
            f"| {r['config']} | {r['window'][0]}-{r['window'][1]} | {r['samples']:,} "
            f"({r['samples_per_step']:,.0f}) | {r['bytes_sent'] / 1e6:,.1f} MB "
            f"| **{r['bytes_per_sample']:,.0f}** "
            f"| {less(ratio)} | {goal} | {less(per_target)} "
            f"| {r['sent_per_peer_per_step'] / 1e6:.2f} MB{round_bytes}, "
            f"{r['received_per_peer_per_step'] / 1e6:.2f} MB "
            f"| {engine} | {r['failed_rounds']} |"
        )


def less(ratio: float) -> str:
    """A ratio against the sync arm, or a dash where there was none (``--no-sync``)."""
    return "-" if math.isnan(ratio) else f"{ratio:.1f}x less"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s each way")
    ap.add_argument("--local-steps", type=int, nargs="+", default=[10, 50, 100], help="DiLoCo's H values")
    ap.add_argument("--no-sync", action="store_true", help="skip the synchronous configuration")
    ap.add_argument("--topk", action="store_true", help="also DiLoCo with --outer-compression topk, per H")
    ap.add_argument("--no-dense", action="store_true", help="with --topk: the sparse DiLoCo runs alone")
    ap.add_argument("--keep-logs", action="store_true", help="cotrain's info lines in the peers' logs")
    ap.add_argument("--target-batch-size", type=int, default=0,
                    help="swarm batch per sync step / DiLoCo inner step (default: peers x micro-batch x "
                    "accumulation: one opt.step call per peer)")  # fmt: skip
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=8, help="micro-batches per opt.step call")
    ap.add_argument("--step-time", type=float, default=0.05, help="simulated s per micro-batch")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument(
        "--averaging-timeout",
        type=float,
        default=0.0,
        help="s (default: the preset's 60, or 3 x the bound of a DiLoCo round's all-reduce if more)",
    )
    ap.add_argument("--warmup", type=int, default=1, help="global steps / rounds before the window")
    ap.add_argument("--steps", type=int, default=8, help="sync: global steps timed")
    ap.add_argument("--rounds", type=int, default=2, help="diloco: rounds timed")
    ap.add_argument("--limit", type=float, default=3000.0, help="stop everything after this many seconds")
    ap.add_argument("--quick", action="store_true", help="H = 10 and 50, 4 sync steps, 1 round each")
    ap.add_argument(
        "--model-params", type=int, default=0, help="a simulated model of N parameters (utilization.py)"
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.local_steps, args.steps, args.rounds = [10, 50], 4, 1
    if not args.target_batch_size:
        args.target_batch_size = args.peers * args.micro_batch * args.accumulation
    if not args.averaging_timeout:  # a DiLoCo round that carries the outer state: 3 fp16 vectors
        bound = netns.allreduce_bound_s(args.peers, 3 * 2 * ALBERT_LARGE_PARAMS, args.rate * 1e6)
        args.averaging_timeout = float(max(60, math.ceil(3 * bound)))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    netns.prepare_namespaces("traffic.py", args.limit)
    started = netns.print_started()
    tmp = Path(tempfile.mkdtemp(prefix="cotrain-traffic-"))
    rows = []
    try:
        for name, mode, h, timed in configs(args):
            rows.append(run_config(name, mode, h, timed, args, tmp))
    except BaseException:
        print(f"peers' logs kept in {tmp}", file=sys.stderr)
        raise
    if args.keep_logs:
        print(f"peers' logs kept in {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows, args)
    netns.print_finished(started)
    summary = {
        "peers": args.peers,
        "rate_mbit": args.rate,
        "target_batch_size": args.target_batch_size,
        "goal_met": all(r.get("goal_met", False) for r in rows if r.get("local_steps")) and bool(rows),
        "rows": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
