"""Endurance: a monitor, an evaluation peer and ``--trainers`` trainers for ``--minutes`` with churn, every
process's memory sampled.

The roles are cotrain's own (``cotrain monitor``, ``cotrain eval``, ``cotrain train``) with real compute: the
``albert-tiny`` preset on the built-in demo corpus (or ``--dataset-path``), on 127.0.0.1, one CPU thread
each. Every ``--kill-every`` seconds a random trainer's whole process tree is SIGKILLed (its machine vanished)
and a new trainer joins. Every ``--interval`` seconds each role's processes are sampled (PSS, as in
``benchmarks/footprint.py``: the supervisor, the worker, the DHT, p2pd, the averagers, torch's shm manager).

What it checks, after ``--settle`` seconds (10 minutes by default):
- memory: for every role that ran from the end of the settling time to the end (the monitor, the evaluation
  peer, the trainers churn spared), the PSS of each of its process kinds, and of its whole tree, from the
  mean of the first quarter of the samples after settling to the mean of the last quarter; goal: no growth
  above 5%;
- crashes: roles that exited without being killed;
- hangs: the longest time between two global steps the monitor logged, against the longest a step may take
  (the median step, plus the matchmaking time and the averaging timeout);
- learning: the evaluation peer's held-out loss at its first evaluation, at the end of the settling time and
  at the end (it must keep falling), and the swarm's training loss (the monitor's, each the mean of 20 global
  steps) at the same three points. On the demo corpus (1,323 training sequences, seen dozens of times in an
  hour) the held-out loss stops falling long before the training loss does: a larger ``--dataset-path`` keeps
  the two together.

    python benchmarks/soak.py [--minutes 60] [--trainers 4] [--kill-every 300] [--settle 600] [--json FILE]

``--json`` also keeps every memory sample (PSS per process kind of each role, and split into anonymous memory,
mapped files and shared memory), the kills and the evaluations.
The last line is ``{"event": "soak_summary", "minutes": ..., "max_growth": ..., "crashed": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import print_finished, print_started  # noqa: E402
from lib.procs import growth, sample  # noqa: E402
from lib.roles import LOCALHOST, Swarm, prepare_demo, read_jsonl  # noqa: E402

GOAL_GROWTH = 0.05


def memory_growth(samples: list[tuple[float, list[dict]]], since: float) -> dict[str, float]:
    """Per process kind of one role (and ``total``, its whole tree): the growth of its PSS (summed over the
    processes of that kind) over the samples taken at or after ``since``."""
    after = [rows for t, rows in samples if t >= since]
    if len(after) < 2:
        return {}
    kinds = sorted({r["kind"] for rows in after for r in rows})
    out = {}
    for kind in (*kinds, "total"):
        series = [sum(r["pss"] for r in rows if kind in ("total", r["kind"])) for rows in after]
        out[kind] = round(growth(series), 4)
    return out


def per_kind(rows: list[dict]) -> dict[str, float]:
    """One memory sample of a role: PSS (MiB) per process kind, summed over the processes of that kind."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["kind"]] = round(out.get(r["kind"], 0.0) + r["pss"], 1)
    return out


def per_kind_split(rows: list[dict]) -> dict[str, dict[str, float]]:
    """One memory sample of a role: per process kind, its PSS by what backs it (anonymous memory, mapped
    files, shared memory; lib.procs.pss_split), summed over the processes of that kind."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        split = out.setdefault(r["kind"], {})
        for measure in ("pss_anon", "pss_file", "pss_shmem"):
            if measure in r:
                split[measure] = round(split.get(measure, 0.0) + r[measure], 1)
    return out


def step_gaps(monitor_rows: list[dict]) -> tuple[float, float]:
    """(median, longest) seconds between two consecutive global steps of the monitor's training rows."""
    times: dict[int, float] = {}
    for r in monitor_rows:
        if r.get("kind") is None and isinstance(r.get("step"), int) and "time" in r:
            times.setdefault(r["step"], r["time"])
    ordered = [times[s] for s in sorted(times)]
    gaps = [b - a for a, b in zip(ordered, ordered[1:], strict=False)]
    if not gaps:
        return 0.0, 0.0
    return statistics.median(gaps), max(gaps)


def held_out(monitor_rows: list[dict], settle_at: float) -> list[float]:
    """The evaluation peer's held-out loss: first, the last one before ``settle_at`` (wall clock), last."""
    evals = [
        (r["time"], r["eval_loss"]) for r in monitor_rows if r.get("kind") == "eval" and "eval_loss" in r
    ]
    if not evals:
        return []
    before = [loss for t, loss in evals if t <= settle_at] or [evals[0][1]]
    return [evals[0][1], before[-1], evals[-1][1]]


def training_loss(monitor_rows: list[dict], settle_at: float, window: int = 20) -> list[float]:
    """The swarm's training loss (the monitor's per-step lines), each the mean of ``window`` global steps: the
    first ones, the last ones before ``settle_at`` (wall clock), the last ones of the run."""
    rows = [r for r in monitor_rows if r.get("kind") is None and isinstance(r.get("loss"), (int, float))]
    if not rows:
        return []

    def mean(part: list[dict]) -> float:
        return statistics.fmean(r["loss"] for r in part)

    before = [r for r in rows if r["time"] <= settle_at] or rows[:window]
    return [mean(rows[:window]), mean(before[-window:]), mean(rows[-window:])]


def kill_tree(pid: int) -> None:
    """SIGKILL a role's supervisor and every process below it (the worker runs in a session of its own, so
    its process group is not the supervisor's): its machine vanished."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def common_args(args) -> list[str]:
    """What every role of the run is given: the preset, the run, 127.0.0.1 and the timing settings."""
    return ["--preset", args.preset, "--run-id", "soak", "--host-maddrs", LOCALHOST,
            "--max-seq-length", "128", "--matchmaking-time", str(args.matchmaking_time),
            "--averaging-timeout", str(args.averaging_timeout), "--torch-threads", "1"]  # fmt: skip


def monitor_argv(args, root: Path, data: Path) -> list[str]:
    """The monitor: it checkpoints every 20 global steps, so it keeps and serves the state."""
    return ["monitor", *common_args(args), "--output-dir", str(root / "monitor"), "--dataset-path", str(data),
            "--save-every", "20", "--refresh-period", "1", "--dashboard-port", "-1"]  # fmt: skip


def eval_argv(args, root: Path, data: Path, initial: list[str]) -> list[str]:
    """The evaluation peer: the held-out loss every 60 s."""
    return ["eval", *common_args(args), "--initial-peers", *initial, "--dataset-path", str(data),
            "--output-dir", str(root / "eval"), "--eval-every", "60", "--eval-batches", "4"]  # fmt: skip


def trainer_argv(args, root: Path, data: Path, initial: list[str], count: int) -> list[str]:
    """The ``count``-th trainer of the run (its seed)."""
    return ["train", *common_args(args), "--initial-peers", *initial, "--dataset-path", str(data),
            "--output-dir", str(root / f"trainer{count}"), "--seed", str(count),
            "--per-device-train-batch-size", "8"]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--trainers", type=int, default=4)
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--dataset-path", type=Path, help="a prepared dataset (default: the demo corpus)")
    ap.add_argument("--kill-every", type=float, default=300.0, help="s between trainers killed (0: no churn)")
    ap.add_argument("--settle", type=float, default=600.0, help="s before memory growth is measured")
    ap.add_argument("--interval", type=float, default=30.0, help="s between memory samples")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0, help="which trainers are killed")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.settle >= args.minutes * 60:
        ap.error("--settle must be shorter than the run (--minutes)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = print_started()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="cotrain-soak-") as tmp:
        root = Path(tmp)
        data = args.dataset_path or root / "data"
        if not args.dataset_path:
            prepare_demo(data, args.preset, 128)
        swarm = Swarm(root)
        samples: dict[str, list[tuple[float, list[dict]]]] = {}
        killed: list[str] = []
        kills: list[tuple[float, str, str]] = []  # (s since the start, killed, started)
        try:
            swarm.start("monitor", monitor_argv(args, root, data), threads=1)
            peers = root / "monitor" / "initial_peers.txt"
            deadline = time.monotonic() + 180
            while not peers.exists():
                if time.monotonic() > deadline or swarm.dead():
                    raise SystemExit(f"the monitor did not start; see {root / 'monitor.log'}")
                time.sleep(0.5)
            initial = [a for a in peers.read_text().split() if "/127.0.0.1/" in a]
            swarm.start("eval", eval_argv(args, root, data, initial), threads=1)
            count = 0

            def new_trainer() -> str:
                nonlocal count
                name = f"trainer{count}"
                swarm.start(name, trainer_argv(args, root, data, initial, count), threads=1)
                count += 1
                return name

            for _ in range(args.trainers):
                new_trainer()
            t0 = time.monotonic()
            settle_at = t0 + args.settle
            settle_wall = time.time() + args.settle
            end = t0 + args.minutes * 60
            next_kill = t0 + args.kill_every if args.kill_every > 0 else float("inf")
            next_sample = t0
            while time.monotonic() < end:
                now = time.monotonic()
                crashed = [n for n in swarm.dead() if n not in killed]
                if "monitor" in crashed:
                    break
                if now >= next_kill:
                    next_kill = now + args.kill_every
                    alive = [n for n in swarm.procs if n.startswith("trainer") and n not in swarm.dead()]
                    victim = rng.choice(alive)
                    kill_tree(swarm.procs[victim].pid)
                    killed.append(victim)
                    joined = new_trainer()
                    kills.append((round(now - t0, 1), victim, joined))
                    print(f"  {now - t0:.0f} s: {victim} killed, {joined} started", flush=True)
                if now >= next_sample:
                    next_sample = now + args.interval
                    swarm.remember_tree()
                    for name, proc in swarm.procs.items():
                        if proc.poll() is None:
                            samples.setdefault(name, []).append((now, sample(proc.pid)))
                    if int((now - t0) // args.interval) % 10 == 0:
                        rows = read_jsonl(root / "monitor" / "metrics.jsonl")
                        step = max((r.get("step", 0) for r in rows if r.get("kind") is None), default=0)
                        print(f"  {now - t0:.0f} s: global step {step}", flush=True)
                time.sleep(1.0)
            t1 = time.monotonic()
            crashed = [n for n in swarm.dead() if n not in killed]
        finally:
            swarm.stop()
        monitor_rows = read_jsonl(root / "monitor" / "metrics.jsonl")
    # roles that ran from the end of the settling time to the end of the run
    whole = [
        name
        for name, taken in samples.items()
        if name not in killed and taken[0][0] <= settle_at and taken[-1][0] >= t1 - 2 * args.interval
    ]
    growths = {name: memory_growth(samples[name], settle_at) for name in whole}
    median_gap, longest_gap = step_gaps(monitor_rows)
    bound = median_gap + args.matchmaking_time + args.averaging_timeout
    loss = held_out(monitor_rows, settle_wall)
    steps = [r["step"] for r in monitor_rows if r.get("kind") is None and isinstance(r.get("step"), int)]
    print(f"\n{'role':10s} {'process':18s} {'PSS MiB at settle':>18s} {'PSS MiB at end':>15s} {'growth':>8s}")
    for name in whole:
        after = [rows for t, rows in samples[name] if t >= settle_at]
        for kind, g in growths[name].items():
            first = sum(r["pss"] for r in after[0] if kind in ("total", r["kind"]))
            last = sum(r["pss"] for r in after[-1] if kind in ("total", r["kind"]))
            print(f"{name:10s} {kind:18s} {first:18.0f} {last:15.0f} {100 * g:+7.1f}%")
    worst = max(((g, f"{n} {k}") for n, gs in growths.items() for k, g in gs.items()), default=(0.0, "-"))
    summary = {
        "event": "soak_summary",
        "minutes": round((t1 - t0) / 60, 1),
        "trainers": args.trainers,
        "killed": len(killed),
        "crashed": crashed,
        "global_steps": max(steps, default=0),
        "max_growth": round(worst[0], 4),
        "max_growth_at": worst[1],
        "growth_goal": GOAL_GROWTH,
        "median_step_s": round(median_gap, 1),
        "longest_step_s": round(longest_gap, 1),
        "step_bound_s": round(bound, 1),
        "hung": longest_gap > bound,
        "held_out_loss": [round(x, 4) for x in loss],
        "training_loss": [round(x, 4) for x in training_loss(monitor_rows, settle_wall)],
        "loss_falling": len(loss) == 3 and loss[2] < loss[1] <= loss[0],
    }
    if args.json:
        series = {
            name: [(round(t - t0, 1), per_kind(rows)) for t, rows in taken] for name, taken in samples.items()
        }
        evals = [(r["time"], r["step"], r["eval_loss"]) for r in monitor_rows if r.get("kind") == "eval"]
        split = {
            name: [(round(t - t0, 1), per_kind_split(rows)) for t, rows in taken]
            for name, taken in samples.items()
        }
        results = {
            "growth": growths,
            "summary": summary,
            "memory": series,
            "memory_by_backing": split,
            "kills": kills,
            "evaluations": evals,
        }
        args.json.write_text(json.dumps(results) + "\n")
    print_finished(started)
    print(json.dumps(summary), flush=True)
    return 0 if not crashed else 1


if __name__ == "__main__":
    sys.exit(main())
