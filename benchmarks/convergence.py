"""Convergence with 1, 2 and 4 peers at the same global batch: loss against samples, and the final gap.

The tiny ALBERT (preset ``albert-tiny``: target batch 64, micro-batches of 8) is trained on WikiText-2's
validation file prepared with ``cotrain prepare`` (max length 128), by real swarms on 127.0.0.1: a
``cotrain monitor`` as the first peer and N ``cotrain train`` processes joining it, each with its own data
seed, all stopping at ``--steps`` global steps (``--max-steps``). Every configuration runs with ``--seeds``
different seeds (the peers' data order and masking; the model's initial weights are the same in every run).

Each trainer writes one line per global step to ``metrics.jsonl`` in its output folder: its mean loss over the
micro-batches it contributed to that step and its cumulative contribution in samples. The swarm's curve is
the sample-weighted loss of its trainers at each step against the swarm's cumulative samples. The final loss
of a run is its mean loss over the last quarter of the samples that every run reached (the same sample
window for all). Reported: the gap between N peers and 1 peer (mean over seeds), beside the seed-to-seed
spread of each configuration. A PNG of all curves goes to ``--plot`` (default docs/convergence.png).

    python benchmarks/convergence.py [--peers 1 2 4] [--seeds 2] [--steps 24] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import TimeUp, die_with_parent, install_exit_handlers  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
GOAL = 0.02
LOCALHOST = "/ip4/127.0.0.1/tcp/0"
PRESET = "albert-tiny"


class Swarm:
    """A monitor and N trainers of one run, each a `cotrain` CLI process in a process group of its own."""

    def __init__(self, out: Path):
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        self.tree: set[int] = set()

    def start(self, name: str, args: list[str], threads: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        with open(self.out / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "cotrain", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                preexec_fn=die_with_parent,
            )

    def remember_tree(self) -> None:
        """Note every descendant (workers, DHT, averagers, p2pd) so that none outlives the benchmark."""
        for proc in self.procs.values():
            try:
                root = psutil.Process(proc.pid)
                self.tree.update(p.pid for p in [root, *root.children(recursive=True)])
            except psutil.Error:
                pass

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, grace: float = 20.0) -> None:
        self.remember_tree()
        trainers = [p for n, p in self.procs.items() if n != "monitor"]
        monitor = [p for n, p in self.procs.items() if n == "monitor"]
        for group in (trainers, monitor):  # trainers first: the monitor serves them until they are gone
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in group:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        time.sleep(0.5)
        for pid in self.tree:  # anything left of this run's process trees
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
            except psutil.Error:
                pass


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return rows


def swarm_curve(trainer_rows: list[list[dict]]) -> list[tuple[int, int, float]]:
    """(global step, cumulative swarm samples, sample-weighted loss) from the trainers' per-step lines."""
    per_step: dict[int, list[tuple[float, int]]] = {}
    contribution: list[dict[int, int]] = []
    for rows in trainer_rows:
        seen, last = {}, 0
        for r in sorted((r for r in rows if "step" in r and "contribution" in r), key=lambda r: r["step"]):
            samples = r["contribution"] - last
            if r.get("loss") is not None and samples > 0:
                per_step.setdefault(r["step"], []).append((r["loss"], samples))
            last = seen[r["step"]] = r["contribution"]
        contribution.append(seen)
    curve = []
    for step in sorted(per_step):
        total = 0
        for seen in contribution:
            before = [c for s, c in seen.items() if s <= step]
            total += max(before, default=0)
        weight = sum(n for _, n in per_step[step])
        curve.append((step, total, sum(loss * n for loss, n in per_step[step]) / weight))
    return curve


def final_loss(curve: list[tuple[int, int, float]], lo: float, hi: float, points: int = 50) -> float:
    """Mean of the loss curve (linearly interpolated between steps) over the samples [lo, hi]."""
    import numpy as np

    if not curve or curve[-1][1] < hi:
        return float("nan")
    samples = np.array([c[1] for c in curve], dtype=float)
    loss = np.array([c[2] for c in curve], dtype=float)
    return float(np.interp(np.linspace(lo, hi, points), samples, loss).mean())


def run_swarm(peers: int, seed: int, args, data: Path, root: Path) -> dict:
    out = root / f"peers{peers}-seed{seed}"
    out.mkdir(parents=True)
    run_id = f"conv{peers}s{seed}"
    common = ["--preset", PRESET, "--run-id", run_id, "--host-maddrs", LOCALHOST]
    threads = 1  # as `cotrain demo` runs its peers; speed does not change what is measured here
    swarm = Swarm(out)
    started = time.monotonic()
    try:
        swarm.start(
            "monitor",
            [
                "monitor",
                *common,
                "--output-dir",
                str(out / "monitor"),
                "--refresh-period",
                "1",
                "--dashboard-port",
                "-1",
                "--torch-threads",
                "1",
            ],
            threads=1,
        )
        peers_file = out / "monitor" / "initial_peers.txt"
        while not peers_file.exists():
            if swarm.dead() or time.monotonic() - started > 180:
                raise RuntimeError(f"the monitor did not start; see {out / 'monitor.log'}")
            time.sleep(0.2)
        initial = [a for a in peers_file.read_text().split() if "/127.0.0.1/" in a]
        for i in range(peers):
            swarm.start(
                f"trainer{i}",
                [
                    "train",
                    *common,
                    "--initial-peers",
                    *initial,
                    "--dataset-path",
                    str(data),
                    "--output-dir",
                    str(out / f"trainer{i}"),
                    "--seed",
                    str(1000 * seed + i),
                    "--max-steps",
                    str(args.steps),
                    "--torch-threads",
                    str(threads),
                    "--statistics-expiration",
                    "30",
                ],
                threads=threads,
            )
        deadline = started + args.run_limit
        last_print = 0.0
        while True:
            time.sleep(1.0)
            swarm.remember_tree()
            rows = [read_jsonl(out / f"trainer{i}" / "metrics.jsonl") for i in range(peers)]
            steps = [max((r.get("step", 0) for r in rs), default=0) for rs in rows]
            if time.monotonic() - last_print > 15:
                print(
                    f"  {peers} peer(s), seed {seed}: steps {steps} after {time.monotonic() - started:.0f} s",
                    flush=True,
                )
                last_print = time.monotonic()
            trainers_done = all(swarm.procs[f"trainer{i}"].poll() is not None for i in range(peers))
            if min(steps) >= args.steps or trainers_done:
                break
            if swarm.procs["monitor"].poll() is not None:
                raise RuntimeError(f"the monitor stopped; see {out / 'monitor.log'}")
            if time.monotonic() > deadline:
                print(f"  {peers} peer(s), seed {seed}: time limit reached at steps {steps}", flush=True)
                break
    finally:
        swarm.stop()
    rows = [read_jsonl(out / f"trainer{i}" / "metrics.jsonl") for i in range(peers)]
    curve = swarm_curve(rows)
    groups = [r.get("group_size", 1) for rs in rows for r in rs]
    return {
        "peers": peers,
        "seed": seed,
        "curve": curve,
        "seconds": time.monotonic() - started,
        "max_group": max(groups, default=1),
        "mean_group": statistics.mean(groups) if groups else 1,
    }


def prepare(data: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "cotrain",
        "prepare",
        "--preset",
        PRESET,
        "--text-files",
        str(WIKITEXT),
        "--output",
        str(data),
        "--max-seq-length",
        "128",
    ]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True, timeout=900)


def plot(runs: list[dict], path: Path, lo: float, hi: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {1: "#222222", 2: "#2f6fde", 4: "#d9541e", 8: "#2a9d4b"}
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=110)
    for run in runs:
        if not run["curve"]:
            continue
        _, samples, loss = zip(*run["curve"], strict=True)
        ax.plot(
            samples,
            loss,
            styles[run["seed"] % len(styles)],
            color=colors.get(run["peers"], "#888888"),
            linewidth=1.4,
            label=f"{run['peers']} peer{'s' if run['peers'] > 1 else ''}, seed {run['seed']}",
        )
    ax.axvspan(lo, hi, color="#999999", alpha=0.15, label="window of the final loss")
    ax.set_xlabel("samples (swarm total)")
    ax.set_ylabel("training loss (MLM + SOP)")
    ax.set_title(f"{PRESET} on WikiText-2 valid, global batch 64: 1 vs 2 vs 4 peers", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seeds", type=int, default=2, help="runs per configuration, each with its own seed")
    ap.add_argument("--steps", type=int, default=24, help="global steps per run (--max-steps)")
    ap.add_argument("--data", help="a dataset prepared from WikiText-2 valid (default: prepare one)")
    ap.add_argument("--plot", default=str(REPO / "docs" / "convergence.png"))
    ap.add_argument("--run-limit", type=float, default=420.0, help="seconds allowed per swarm")
    ap.add_argument("--limit", type=float, default=2400.0, help="stop everything after this many seconds")
    ap.add_argument("--quick", action="store_true", help="1 and 2 peers, 1 seed, 8 steps, no plot")
    args = ap.parse_args()
    if args.quick:
        args.peers, args.seeds, args.steps, args.plot = [1, 2], 1, 8, ""
    if not WIKITEXT.exists():
        sys.exit(f"{WIKITEXT} not found")
    install_exit_handlers(args.limit)
    load = os.getloadavg()
    started = time.time()
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="cotrain-convergence-"))
    runs = []
    try:
        data = Path(args.data) if args.data else tmp / "data"
        if not args.data:
            print("preparing WikiText-2 valid with `cotrain prepare` (max length 128)", flush=True)
            prepare(data)
        for seed in range(args.seeds):
            for peers in args.peers:
                runs.append(run_swarm(peers, seed, args, data, tmp))
    except (BaseException, TimeUp):
        print(f"logs kept in {tmp}", file=sys.stderr)
        raise
    reached = min((r["curve"][-1][1] for r in runs if r["curve"]), default=0)
    lo, hi = 0.75 * reached, reached
    for r in runs:
        r["final"] = final_loss(r["curve"], lo, hi)
    report(runs, args, lo, hi)
    if args.plot:
        plot(runs, Path(args.plot), lo, hi)
        print(f"plot: {args.plot}")
    shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()
    print(
        f"took {time.time() - started:.0f} s; load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


def report(runs: list[dict], args, lo: float, hi: float) -> None:
    by_peers: dict[int, list[dict]] = {}
    for r in runs:
        by_peers.setdefault(r["peers"], []).append(r)
    base = statistics.mean(r["final"] for r in by_peers[min(by_peers)])
    print()
    print(f"final loss: mean over samples {lo:.0f}-{hi:.0f} (the last quarter every run reached)")
    print()
    print(
        "| peers | global steps | group size (max) | final loss per seed | mean | gap vs 1 peer "
        "| seed-to-seed spread |"
    )
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for peers in sorted(by_peers):
        rs = sorted(by_peers[peers], key=lambda r: r["seed"])
        finals = [r["final"] for r in rs]
        mean = statistics.mean(finals)
        gap = (mean - base) / base
        spread = (max(finals) - min(finals)) / mean
        if peers != min(by_peers):
            worst = abs(gap) if math.isnan(gap) else max(worst, abs(gap))
        steps = "/".join(str(r["curve"][-1][0]) if r["curve"] else "0" for r in rs)
        print(
            f"| {peers} | {steps} | {max(r['max_group'] for r in rs)} | "
            f"{', '.join(f'{f:.4f}' for f in finals)} | {mean:.4f} | **{gap:+.2%}** | {spread:.2%} |"
        )
    print()
    met = worst <= GOAL  # False when a gap is NaN (a run did not reach the window)
    print(f"Goal: |gap| <= {GOAL:.0%}: {'met' if met else 'NOT met'} (largest {worst:.2%})")


if __name__ == "__main__":
    main()
