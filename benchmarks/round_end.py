"""The host's work at the end of a DiLoCo round, for source trees side by side.

A lone peer (its own swarm on 127.0.0.1) of a simulated model of ``--model-params`` parameters (the plain
blocks of ``utilization.py``, SGD inner steps, fixed gradients, no compute), with sparse overlapped rounds
(``--outer-compression topk --outer-overlap``, or ``--dense``) of ``--local-steps`` inner steps, one thread.
Each of ``--rounds`` round ends after the first is timed: wall seconds, the process's user and system CPU
seconds, and its minor page faults (fresh memory the kernel zeroes). Each tree given with ``--src`` runs in a
process of its own, in turn, ``--repeats`` times, the trees alternating so that a drift of the machine falls
on all of them.

What it times is the training thread's part of a round's end. A lone peer sends nothing, so since the host's
work of a sparse overlapped round moved to a thread of its own (cotrain.strategies.overlap.RoundEnds) it no
longer encodes at all: compare trees from before that change with care, and measure a swarm's rounds' ends
with ``utilization.py``, which reports them.

    python benchmarks/round_end.py [--src OLD/src NEW/src] [--model-params 100000000] [--rounds 4]

A tree is a ``src`` folder holding a ``cotrain`` package (``git worktree add /tmp/old COMMIT`` gives one of an
older commit); it is put first on PYTHONPATH of the peer. The last line is a JSON summary
``{"event": "round_end_summary", "trees": [{"src": ..., "wall": ..., "user": ..., "sys": ..., "minflt":
...}]}`` (medians over the timed rounds of all repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import print_finished, print_started  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEYS = ("wall", "user", "sys", "minflt")


def peer_main(args: argparse.Namespace) -> None:
    """In the peer's process: train until ``--rounds`` rounds ended, timing each round's end."""
    import resource
    import time

    import torch

    from cotrain.config import resolve
    from cotrain.engine import SwarmConnection
    from lib.netns import fixed_gradients, plain_model, simulated_peer

    torch.set_num_threads(1)
    run = {"run_id": "round-end", "target_batch_size": 32, "strategy": "diloco", "outer_overlap": True}
    run |= {"local_steps": args.local_steps}
    if not args.dense:
        run["outer_compression"] = "topk"
    peer = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "per_device_train_batch_size": 4}
    peer |= {"gradient_accumulation_steps": 8, "matchmaking_time": 2.0, "averaging_timeout": 10.0}
    config = resolve("albert-large-v2", overrides={"run": run, "peer": peer})
    connection = SwarmConnection(config.run.run_id, config.peer, role="trainer")
    model = plain_model(args.model_params)
    swarm = simulated_peer(
        config.run, config.peer, model, connection, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3)
    )
    fixed_gradients(model, 0)
    opt = swarm.strategy.opt
    outer_round = opt.outer_round

    def timed() -> None:
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        outer_round()
        wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        row = {"wall": wall, "user": user, "sys": system, "minflt": after.ru_minflt - before.ru_minflt}
        print(json.dumps({"round": row}), flush=True)

    opt.outer_round = timed
    try:
        while swarm.global_step < args.rounds:
            swarm.step(batch_size=32, zero_grad=False)
    finally:
        swarm.shutdown()


def peer_command(args: argparse.Namespace) -> list[str]:
    """The lone peer's process: this script with ``--peer``."""
    argv = [sys.executable, __file__, "--peer", "--model-params", str(args.model_params)]
    argv += ["--rounds", str(args.rounds), "--local-steps", str(args.local_steps)]
    return argv + (["--dense"] if args.dense else [])


def run_tree(src: Path, args: argparse.Namespace) -> list[dict]:
    """One peer from the tree ``src``: its timed round ends (the first, which allocates, left out)."""
    argv = peer_command(args)
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{Path(__file__).resolve().parent}")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.limit, cwd=REPO)
    rows = [json.loads(line)["round"] for line in out.stdout.splitlines() if line.startswith('{"round"')]
    if out.returncode != 0 or len(rows) < 2:
        sys.exit(f"round_end.py: the peer of {src} failed (exit code {out.returncode}): {out.stderr[-2000:]}")
    return rows[1:]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, nargs="+", default=[REPO / "src"], help="source trees to compare")
    ap.add_argument("--model-params", type=int, default=100_000_000)
    ap.add_argument("--local-steps", type=int, default=5, help="inner steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per peer (the first is not timed)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dense", action="store_true", help="dense overlapped rounds instead of topk")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a peer may take")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peer:
        return peer_main(args)
    for src in args.src:
        if not (src / "cotrain").is_dir():
            sys.exit(f"round_end.py: error: {src} holds no cotrain package")
    started = print_started()
    rows: dict[Path, list[dict]] = {src: [] for src in args.src}
    for _ in range(args.repeats):
        for src in args.src:
            rows[src] += run_tree(src, args)
    summary = []
    print("| tree | wall s | user s | system s | minor page faults |\n|---|---|---|---|---|")
    for src, timed in rows.items():
        med = {key: statistics.median(r[key] for r in timed) for key in KEYS}
        print(f"| {src} | {med['wall']:.2f} | {med['user']:.2f} | {med['sys']:.2f} | {med['minflt']:,.0f} |")
        summary.append({"src": str(src), "rounds": len(timed), **med})
    print_finished(started)
    print(json.dumps({"event": "round_end_summary", "trees": summary}))


if __name__ == "__main__":
    main()
