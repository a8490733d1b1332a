"""The monitor's link as the clients' reducer: how a round's time grows as client trainers are added.

A swarm of client trainers (``--client-mode``: nobody can dial them, as behind NAT) averages only through
public peers that reduce for them as auxiliary peers, which the monitor does (cotrain.hivemind_ext.auxiliary).
Each client sends its vector to the reducers and receives the average, so the reducers' links carry one vector
per client each way and every round: this benchmark measures that on shaped links.

The hosts are network namespaces (``netns.Network``), every link shaped to ``--rate`` Mbit/s each way. For
each count of clients in ``--clients`` and each mode in ``--modes`` (``diloco``: dense fp16 rounds;
``diloco-topk``: sparse rounds), a fresh swarm runs:

- ``--reducers`` public peers (1 by default) that train nothing and run the strategy's auxiliary reducer, as
  the monitor does (``Strategy.reducer``, built on the same model shapes as the trainers'), the first of them
  the swarm's first peer;
- the client trainers: the peers of ``utilization.py`` (``lib/simulated.py``) in client mode, cotrain's DHT
  and ``cotrain.SwarmPeer`` with DiLoCo for the real ALBERT-large model of the ``albert-large-v2`` preset
  (17.8M parameters), their forward and backward passes simulated by a sleep (``--step-time`` s per
  micro-batch), ``--local-steps`` inner steps per round.

Reported per configuration, over ``--rounds`` rounds after a warm-up round: the seconds per round and how long
the trainers waited for the round's all-reduce (``opt.step`` time less the inner steps), the bytes the
reducers' links carried per round each way (the veths' counters: everything on the wire), the bytes a client
sent per round, the engine's payload per client (``round_bytes``), the bound ``clients x payload / (reducers x
rate)``, and the rounds each reducer took part in.

    python benchmarks/aux_load.py [--clients 2 4 6] [--reducers 1] [--rate 100] [--modes diloco diloco-topk]
        [--local-steps 10] [--rounds 2] [--keep-logs]

Needs root and iproute2. The last line printed is a JSON summary.
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
from lib.netns import LinkCounters, Peers  # noqa: E402
from lib.simulated import ALBERT_LARGE_PARAMS as PARAMS  # noqa: E402
from lib.simulated import REPO, collect_marks, worker_argv  # noqa: E402


def peer_argv(mode: str, clients: int, args) -> list[str]:
    """The command line of the peers of one swarm (``Peers.start`` adds ``--aux`` or ``--client-mode``):
    the real ALBERT-large model, rounds timed out at 3 x the bound of the largest at the reducers' links."""
    inner_batch = clients * args.micro_batch * args.accumulation
    payload = 3 * 2 * PARAMS  # the largest round (it carries the outer state): 3 fp16 vectors per client
    timeout = 3 * netns.allreduce_bound_s(2, clients * payload / args.reducers, args.rate * 1e6)
    settings = {"peers": clients, "averaging_timeout": float(max(60, math.ceil(timeout))), "model_params": 0}
    return worker_argv(mode, argparse.Namespace(**{**vars(args), **settings}), 2 + args.rounds, inner_batch)


def run_config(mode: str, clients: int, args, logdir: Path) -> dict:
    """One swarm of ``args.reducers`` auxiliary reducers and ``clients`` client trainers."""
    label = f"{mode} {clients} clients"
    reducers = list(range(args.reducers))
    trainers = list(range(args.reducers, args.reducers + clients))
    a, b = 1, 1 + args.rounds
    worker = peer_argv(mode, clients, args)
    reduced: list[list[int]] = []
    with netns.Network(len(reducers) + clients, args.rate) as net:
        counters = LinkCounters(net)
        peers = Peers(net, worker, logdir / f"{mode}-{clients}", cwd=REPO)
        peers.logdir.mkdir(parents=True, exist_ok=True)
        try:
            peers.start(0, ["--aux"])
            first = peers.receive(0, 300)["maddrs"][0]
            for i in [*reducers[1:], *trainers]:
                role = ["--aux"] if i in reducers else ["--client-mode"]
                peers.start(i, ["--initial-peer", first, *role])
            for i in [*reducers[1:], *trainers]:
                peers.receive(i, 300)  # its addresses
            for i in [*reducers, *trainers]:
                peers.receive(i, 300)  # ready
            peers.send({"op": "go"})
            net.remember_pids()
            marks = collect_marks(peers, trainers, b, label)
            for i in reducers:
                peers.send({"op": "quit"}, only=i)
                reduced.append(peers.receive(i, 60)["reduced"])
        except RuntimeError as e:
            print(f"  {label}: {e}", flush=True)
            return {"mode": mode, "clients": clients, "ok": False, "error": str(e)}
        finally:
            net.remember_pids()
            peers.stop()
            counters.close()
    return summarize(mode, marks, counters, reducers, (a, b), args.rate, reduced)


def summarize(
    mode: str,
    marks: dict[int, dict[int, dict]],
    counters,
    reducers: list[int],
    window: tuple[int, int],
    rate_mbit: float,
    reduced: list[list[int]],
) -> dict:
    """One configuration's figures per round, between the trainers' marks at rounds ``window`` (the hosts'
    link counters ``counters``: a ``LinkCounters``)."""
    a, b = window
    trainers = sorted(marks)
    t0 = min(marks[i][a]["t"] for i in trainers)
    t1 = max(marks[i][b]["t"] for i in trainers)
    links = counters.between(t0, t1)
    rounds = b - a

    def per_round(key: str) -> float:  # the trainers' mean of a counter's growth over the window, per round
        return statistics.mean((marks[i][b][key] - marks[i][a][key]) / rounds for i in trainers)

    round_bytes = statistics.mean(marks[i][b]["round_bytes"] for i in trainers)
    return {
        "mode": mode,
        "clients": len(trainers),
        "reducers": len(reducers),
        "ok": True,
        "seconds_per_round": (t1 - t0) / rounds,
        "compute_per_round": per_round("compute") + per_round("on_device"),
        "waited_per_round": per_round("in_step") - per_round("on_device"),
        "reducer_received_per_round": sum(links[r][1] for r in reducers) / rounds,
        "reducer_sent_per_round": sum(links[r][0] for r in reducers) / rounds,
        "client_sent_per_round": statistics.mean(links[i][0] for i in trainers) / rounds,
        "round_bytes": round_bytes,
        "bound_s": len(trainers) * round_bytes / (len(reducers) * rate_mbit * 1e6 / 8),
        "reduced": reduced,
        "failed_rounds": sum(marks[i][b]["rounds"][1] - marks[i][a]["rounds"][1] for i in trainers),
    }


def print_table(rows: list[dict], args) -> None:
    print()
    print(
        f"{args.reducers} reducer(s), {args.rate:g} Mbit/s links, ALBERT-large ({PARAMS / 1e6:.1f}M "
        f"parameters), H = {args.local_steps}, simulated compute {args.step_time:.3f} s per micro-batch of "
        f"{args.micro_batch} x {args.accumulation} accumulated"
    )
    print()
    print("| mode | clients | s per round | trainers waited per round | reducers' link per round, in / out "
          "| per client at the reducers | a client sent | payload per client (round_bytes) "
          "| bound: clients x payload / rate | rounds reduced (failed) "
          "| failed rounds, trainers |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["ok"]:
            print(f"| {r['mode']} | {r['clients']} | failed: {r.get('error', '')[:80]} | | | | | | | | |")
            continue
        print(
            f"| {r['mode']} | {r['clients']} | {r['seconds_per_round']:.1f} s "
            f"| {r['waited_per_round']:.1f} s "
            f"| {r['reducer_received_per_round'] / 1e6:.1f} / {r['reducer_sent_per_round'] / 1e6:.1f} MB "
            f"| {r['reducer_received_per_round'] / r['clients'] / 1e6:.2f} MB "
            f"| {r['client_sent_per_round'] / 1e6:.2f} MB | {r['round_bytes'] / 1e6:.2f} MB "
            f"| {r['bound_s']:.1f} s | {', '.join(f'{d} ({f})' for d, f in r['reduced'])} "
            f"| {r['failed_rounds']} |"
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[2, 4, 6], help="client trainers per swarm")
    ap.add_argument("--reducers", type=int, default=1, help="public auxiliary reducers (monitors)")
    ap.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s each way")
    ap.add_argument("--modes", nargs="+", default=["diloco"], choices=["diloco", "diloco-topk"])
    ap.add_argument("--local-steps", type=int, default=10, help="inner steps per round (H)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds timed after one warm-up round")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=4, help="micro-batches per opt.step call")
    ap.add_argument("--step-time", type=float, default=0.05, help="simulated s per micro-batch")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--limit", type=float, default=1500.0, help="stop a swarm after this many seconds")
    ap.add_argument("--keep-logs", action="store_true", help="cotrain's info lines in the peers' logs")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if min(args.clients) < 2 or args.reducers < 1:
        ap.error("a reducer takes part from two clients on: --clients 2 or more, --reducers 1 or more")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    netns.prepare_namespaces("aux_load.py", len(args.clients) * len(args.modes) * (args.limit + 120))
    started = netns.print_started()
    rows = []
    with netns.logs_folder("cotrain-aux-load-", args.keep_logs) as tmp:
        for mode in args.modes:
            for clients in args.clients:
                rows.append(run_config(mode, clients, args, tmp))
                print(f"  {json.dumps(rows[-1])}", flush=True)
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    netns.print_finished(started)
    print(json.dumps({"event": "aux_load_summary", "rate_mbit": args.rate, "rows": rows}))


if __name__ == "__main__":
    main()
