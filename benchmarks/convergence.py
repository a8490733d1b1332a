"""Convergence with 1, 2 and 4 peers at the same global batch: loss against samples, and the final gap.

The tiny ALBERT (preset ``albert-tiny``: target batch 64, micro-batches of 8) is trained on WikiText-2's
validation file prepared with ``cotrain prepare`` (max length 128), by real swarms on 127.0.0.1: a
``cotrain monitor`` as the first peer and N ``cotrain train`` processes joining it, each with its own data
seed, all stopping at ``--steps`` global steps (``--max-steps``). Every configuration runs with ``--seeds``
different seeds (the peers' data order and masking; the model's initial weights are the same in every run).
The configurations of a seed run side by side (``--parallel``), each peer with one torch thread; the timing
settings ``--matchmaking-time`` and ``--averaging-timeout`` are raised from the preset's so that averaging
rounds succeed on a loaded machine (they change when peers average, not what they compute). A swarm whose
trainer stops before the last step (killed for memory, say) is run again once (``--retries``).

Each trainer writes one line per global step to ``metrics.jsonl`` in its output folder: its mean loss over the
micro-batches it contributed to that step and its cumulative contribution in samples. The swarm's curve is
the sample-weighted loss of its trainers at each step against the swarm's cumulative samples. The final loss
of a run is its mean loss over the last quarter of the samples that every run reached (the same sample
window for all). Reported: the gap between N peers and 1 peer (mean over seeds), beside the seed-to-seed
spread of each configuration. A PNG of all curves goes to ``--plot`` (default docs/convergence.png).

    python benchmarks/convergence.py [--peers 1 2 4] [--seeds 2] [--steps 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from _netns import TimeUp, die_with_parent, install_exit_handlers, print_finished, print_started  # noqa: E402

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
        # fewer malloc arenas: the same work in less memory, so that several swarms fit on a small machine
        env = dict(
            os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", MALLOC_ARENA_MAX="2"
        )
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


class SwarmRun:
    """One configuration (N peers, one seed): a monitor, then N trainers joining it, until they reach the
    last step or the run's time limit."""

    def __init__(self, peers: int, seed: int, args, data: Path, root: Path, attempt: int = 0):
        self.peers, self.seed, self.args, self.data, self.attempt = peers, seed, args, data, attempt
        self.out = root / f"peers{peers}-seed{seed}" / f"attempt{attempt}"
        self.out.mkdir(parents=True)
        run_id = f"conv{peers}s{seed}a{attempt}"
        # timing settings only (they do not change what is computed), generous so that averaging rounds
        # succeed on a loaded machine
        self.common = ["--preset", PRESET, "--run-id", run_id, "--host-maddrs", LOCALHOST,
                       "--matchmaking-time", str(args.matchmaking_time),
                       "--averaging-timeout", str(args.averaging_timeout)]  # fmt: skip
        self.swarm = Swarm(self.out)
        self.started = time.monotonic()
        self.trainers_started = False
        self.finished = False
        self.last_print = 0.0
        self.swarm.start(
            "monitor",
            ["monitor", *self.common, "--output-dir", str(self.out / "monitor"), "--refresh-period", "1",
             "--dashboard-port", "-1", "--torch-threads", "1"],
            threads=1,
        )  # fmt: skip

    @property
    def name(self) -> str:
        return f"{self.peers} peer{'s' if self.peers > 1 else ''}, seed {self.seed}"

    def rows(self) -> list[list[dict]]:
        return [read_jsonl(self.out / f"trainer{i}" / "metrics.jsonl") for i in range(self.peers)]

    def poll(self) -> bool:
        """Advance the run; True once it is over."""
        if self.finished:
            return True
        elapsed = time.monotonic() - self.started
        if not self.trainers_started:
            peers_file = self.out / "monitor" / "initial_peers.txt"
            if peers_file.exists():
                self._start_trainers([a for a in peers_file.read_text().split() if "/127.0.0.1/" in a])
            elif self.swarm.dead() or elapsed > 300:
                raise RuntimeError(f"the monitor did not start; see {self.out / 'monitor.log'}")
            return False
        self.swarm.remember_tree()
        steps = [max((r.get("step", 0) for r in rs), default=0) for rs in self.rows()]
        if time.monotonic() - self.last_print > 30:
            print(f"  {self.name}: steps {steps} after {elapsed:.0f} s", flush=True)
            self.last_print = time.monotonic()
        trainers_done = all(self.swarm.procs[f"trainer{i}"].poll() is not None for i in range(self.peers))
        if self.swarm.procs["monitor"].poll() is not None:
            raise RuntimeError(f"the monitor stopped; see {self.out / 'monitor.log'}")
        if elapsed > self.args.run_limit:
            print(f"  {self.name}: time limit reached at steps {steps}", flush=True)
        elif min(steps) < self.args.steps and not trainers_done:
            return False
        self.finish()
        return True

    def _start_trainers(self, initial: list[str]) -> None:
        for i in range(self.peers):
            self.swarm.start(
                f"trainer{i}",
                ["train", *self.common, "--initial-peers", *initial, "--dataset-path", str(self.data),
                 "--output-dir", str(self.out / f"trainer{i}"), "--seed", str(1000 * self.seed + i),
                 "--max-steps", str(self.args.steps), "--torch-threads", "1",
                 "--statistics-expiration", "30"],
                threads=1,
            )  # fmt: skip
        self.trainers_started = True

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.seconds = time.monotonic() - self.started
            self.swarm.stop()

    def result(self) -> dict:
        return run_result(self.peers, self.seed, self.rows(), self.args.steps, self.seconds)


def run_result(peers: int, seed: int, rows: list[list[dict]], steps: int, seconds: float = 0.0) -> dict:
    groups = [r.get("group_size", 1) for rs in rows for r in rs]
    return {
        "peers": peers,
        "seed": seed,
        "curve": swarm_curve(rows),
        "seconds": seconds,
        "max_group": max(groups, default=1),
        "mean_group": statistics.mean(groups) if groups else 1,
        "failed_rounds": sum(max((r.get("rounds_failed", 0) for r in rs), default=0) for rs in rows),
        # every trainer reached the last step: none died (e.g. killed for memory) or lagged behind
        "complete": all(max((r.get("step", 0) for r in rs), default=0) >= steps for rs in rows),
    }


def collect(folders: list[str], steps: int) -> list[dict]:
    """Runs from the folders of earlier (possibly interrupted) invocations: for each configuration and seed,
    the last attempt whose trainers all reached the last step."""
    found: dict[tuple[int, int], dict] = {}
    for folder in folders:
        for attempt in sorted(Path(folder).glob("peers*-seed*/attempt*")):
            peers, seed = (int(x) for x in attempt.parent.name[len("peers") :].split("-seed"))
            rows = [read_jsonl(t / "metrics.jsonl") for t in sorted(attempt.glob("trainer*")) if t.is_dir()]
            result = run_result(peers, seed, rows, steps)
            if len(rows) == peers and result["complete"]:
                found[peers, seed] = result
    return sorted(found.values(), key=lambda r: (r["seed"], r["peers"]))


def run_all(args, data: Path, root: Path) -> list[dict]:
    """The configurations of a seed run side by side (``--parallel``), the seeds one after the other."""
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        queue = list(args.peers)
        active: list[SwarmRun] = []
        try:
            while queue or active:
                while queue and len(active) < args.parallel:
                    active.append(SwarmRun(queue.pop(0), seed, args, data, root))
                time.sleep(1.0)
                for run in [r for r in active if r.poll()]:
                    active.remove(run)
                    result = run.result()
                    if not result["complete"] and run.attempt < args.retries:
                        print(
                            f"  {run.name}: a trainer stopped before the last step; running it again",
                            flush=True,
                        )
                        active.append(SwarmRun(run.peers, seed, args, data, root, attempt=run.attempt + 1))
                        continue
                    print(f"  {run.name}: done in {run.seconds:.0f} s", flush=True)
                    results.append(result)
        finally:
            for run in active:
                run.finish()
    return results


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
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    for run in runs:
        if not run["curve"]:
            continue
        steps, samples, loss = zip(*run["curve"], strict=True)
        style = dict(color=colors.get(run["peers"], "#888888"), linewidth=1.4)
        label = f"{run['peers']} peer{'s' if run['peers'] > 1 else ''}, seed {run['seed']}"
        ax.plot(samples, loss, styles[run["seed"] % len(styles)], label=label, **style)
        ax2.plot(steps, loss, styles[run["seed"] % len(styles)], **style)
    ax.axvspan(lo, hi, color="#999999", alpha=0.15, label="window of the final loss")
    ax.set_xlabel("samples (swarm total)")
    ax.set_ylabel("training loss (MLM + SOP)")
    ax.set_title(f"{PRESET} on WikiText-2 valid, target batch 64: loss against samples", fontsize=9)
    ax2.set_xlabel("global step")
    ax2.set_title("the same runs against global steps", fontsize=9)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
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
    ap.add_argument("--steps", type=int, default=20, help="global steps per run (--max-steps)")
    ap.add_argument("--data", help="a dataset prepared from WikiText-2 valid (default: prepare one)")
    ap.add_argument("--plot", default=str(REPO / "docs" / "convergence.png"))
    ap.add_argument("--parallel", type=int, default=3, help="swarms (configurations of a seed) run at once")
    ap.add_argument("--matchmaking-time", type=float, default=5.0, help="seconds (a timing setting)")
    ap.add_argument("--averaging-timeout", type=float, default=60.0, help="seconds (a timing setting)")
    ap.add_argument("--run-limit", type=float, default=1200.0, help="seconds allowed per swarm")
    ap.add_argument("--limit", type=float, default=2400.0, help="stop everything after this many seconds")
    ap.add_argument("--retries", type=int, default=1, help="runs again a swarm whose trainer stopped early")
    ap.add_argument("--json", help="also write the runs (curves included) to this file")
    ap.add_argument("--merge", nargs="+", help="report on runs saved with --json instead (later files win)")
    ap.add_argument("--collect", nargs="+", help="report on the run folders of earlier invocations instead")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed, first-seed + 1, ...")
    ap.add_argument("--quick", action="store_true", help="1 and 2 peers, 1 seed, 8 steps, no plot")
    args = ap.parse_args()
    if args.quick:
        args.peers, args.seeds, args.steps, args.plot = [1, 2], 1, 8, ""
    if args.collect:
        return finish(collect(args.collect, args.steps), args)
    if args.merge:
        merged = {}
        for name in args.merge:
            for run in json.loads(Path(name).read_text()):
                merged[run["peers"], run["seed"]] = run
        return finish(sorted(merged.values(), key=lambda r: (r["seed"], r["peers"])), args)
    if not WIKITEXT.exists():
        sys.exit(f"{WIKITEXT} not found")
    install_exit_handlers(args.limit)
    started = print_started()
    tmp = Path(tempfile.mkdtemp(prefix="cotrain-convergence-"))
    runs = []
    try:
        data = Path(args.data) if args.data else tmp / "data"
        if not args.data:
            print("preparing WikiText-2 valid with `cotrain prepare` (max length 128)", flush=True)
            prepare(data)
        runs = run_all(args, data, tmp)
    except (BaseException, TimeUp):
        print(f"logs kept in {tmp}", file=sys.stderr)
        raise
    if args.json:
        Path(args.json).write_text(json.dumps(runs))
    finish(runs, args)
    shutil.rmtree(tmp, ignore_errors=True)
    print_finished(started)


def finish(runs: list[dict], args) -> None:
    reached = min((r["curve"][-1][1] for r in runs if r["curve"]), default=0)
    lo, hi = 0.75 * reached, reached
    last_step = min((r["curve"][-1][0] for r in runs if r["curve"]), default=0)
    for r in runs:
        r["final"] = final_loss([tuple(c) for c in r["curve"]], lo, hi)
        # the same over the last quarter of the global steps (a step averages more samples with more peers)
        by_step = [(s, s, loss) for s, _, loss in r["curve"]]
        r["final_steps"] = final_loss(by_step, 0.75 * last_step, last_step)
    report(runs, args, lo, hi)
    if args.plot:
        plot(runs, Path(args.plot), lo, hi)
        print(f"plot: {args.plot}")


def report(runs: list[dict], args, lo: float, hi: float) -> None:
    by_peers: dict[int, list[dict]] = {}
    for r in runs:
        by_peers.setdefault(r["peers"], []).append(r)
    base = statistics.mean(r["final"] for r in by_peers[min(by_peers)])
    base_steps = statistics.mean(r["final_steps"] for r in by_peers[min(by_peers)])
    print()
    print(f"final loss: mean over samples {lo:.0f}-{hi:.0f} (the last quarter every run reached)")
    print()
    print(
        "| peers | global steps | samples per step | averaging group (mean, max) | failed rounds "
        "| final loss per seed | mean | gap vs 1 peer | seed-to-seed spread | gap at equal steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for peers in sorted(by_peers):
        rs = sorted(by_peers[peers], key=lambda r: r["seed"])
        finals = [r["final"] for r in rs]
        mean = statistics.mean(finals)
        gap = (mean - base) / base
        spread = (max(finals) - min(finals)) / mean
        if peers != min(by_peers):
            worst = abs(gap) if math.isnan(gap) else max(worst, abs(gap))
        steps = ", ".join(
            (str(r["curve"][-1][0]) if r["curve"] else "0")
            + ("" if r.get("complete", True) else " (a trainer died)")
            for r in rs
        )
        group = f"{statistics.mean(r['mean_group'] for r in rs):.2f}, {max(r['max_group'] for r in rs)}"
        per_step = statistics.mean(r["curve"][-1][1] / r["curve"][-1][0] for r in rs if r["curve"])
        print(
            f"| {peers} | {steps} | {per_step:.1f} | {group} | {sum(r.get('failed_rounds', 0) for r in rs)} "
            f"| {', '.join(f'{f:.4f}' for f in finals)} | {mean:.4f} | **{gap:+.2%}** | {spread:.2%} "
            f"| {(statistics.mean(r['final_steps'] for r in rs) - base_steps) / base_steps:+.2%} |"
        )
    print()
    met = worst <= GOAL  # False when a gap is NaN (a run did not reach the window)
    print(f"Goal: |gap| <= {GOAL:.0%}: {'met' if met else 'NOT met'} (largest {worst:.2%})")


if __name__ == "__main__":
    main()
