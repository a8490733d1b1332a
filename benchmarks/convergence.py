"""Convergence at the same global batch: 1, 2 and 4 peers, synchronous or DiLoCo, loss against samples.

A tiny model (``--preset``: ``albert-tiny`` by default, or ``gpt2-tiny``) is trained on WikiText-2's
validation file prepared with ``cotrain prepare`` (``--seq-length``, 128 by default), by real swarms on
127.0.0.1: a ``cotrain monitor`` as the first peer and N ``cotrain train`` processes joining it, each with its
own data seed. An *arm* is a number of peers and a strategy: ``4`` is 4 peers averaging gradients at every
global step (``--strategy sync``), ``4:diloco:10`` is 4 peers with ``--strategy diloco --local-steps 10``.
``4:diloco-topk:10`` the same with sparse rounds (``--outer-compression topk``). ``--peers 1 2 4`` is short
for the sync arms ``1 2 4``; ``--arms 1 4 4:diloco:10 4:diloco:50`` mixes them.
All arms see the same number of samples: ``--steps`` counts synchronous global steps of
``--target-batch-size`` samples, a DiLoCo round is ``--local-steps`` of them, so a DiLoCo arm stops at
``--steps / H`` rounds (``--max-steps``). Its learning-rate schedule counts inner steps (H per round): with
micro-batches of ``target / N`` samples per peer (``--per-device-train-batch-size``) each peer takes H inner
steps a round, and ``--warmup-steps``/``--total-steps`` are the same schedule in every arm. Every arm runs
with ``--seeds`` different seeds (the peers' data order and masking; the model's initial weights are the same
in every run). The arms of a seed run side by side (``--parallel``), each peer with one torch thread; the
timing settings ``--matchmaking-time`` and ``--averaging-timeout`` only change when peers average, not what
they compute. A swarm whose trainer stops before the last step is run again once (``--retries``).

Each trainer writes one line per global step to ``metrics.jsonl`` in its output folder: its mean loss over the
micro-batches it contributed to that step and its cumulative contribution in samples. The swarm's training
curve is the sample-weighted loss of its trainers at each step against the swarm's cumulative samples; a run's
final training loss is its mean over the last quarter of the samples that every run reached. With
``--eval-every S`` each swarm also has an evaluation peer (``cotrain eval``, seed 0: the same held-out batches
in every run) that measures the swarm's state every S seconds, and the monitor keeps the swarm's state so that
the final one outlives the trainers; the run waits for the evaluation of the final state, whose held-out loss
is then the run's main number. Reported per arm: the final losses per seed, their mean, the gap to 1 peer and
(DiLoCo) to the synchronous arm with as many peers. A PNG of the curves goes to ``--plot``.

    python benchmarks/convergence.py [--peers 1 2 4] [--seeds 2] [--steps 20] [--quick]
    python benchmarks/convergence.py --preset gpt2-tiny --seq-length 64 --target-batch-size 32 \\
        --per-device-train-batch-size 8 --arms 1 4 4:diloco:10 4:diloco:50 --steps 100 --eval-every 30
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import TimeUp, install_exit_handlers, print_finished, print_started  # noqa: E402
from lib.roles import LOCALHOST, REPO, WIKITEXT, Swarm, prepare_wikitext, read_jsonl  # noqa: E402

GOAL = 0.02  # |gap| of N sync peers to 1 peer
DILOCO_GOAL = 0.03  # |gap| of DiLoCo to sync with as many peers


class Arm:
    """N peers with a strategy: ``4`` (sync), ``4:diloco:10`` (DiLoCo, 10 local steps per round;
    ``4:diloco-topk:10`` with sparse rounds, ``--outer-compression topk``), or ``4@58``
    (sync for 58 global steps instead of ``--steps``, its schedule scaled to match: for a swarm whose steps
    overshoot the target batch, the same samples as the others in fewer steps)."""

    USAGE = "give PEERS, PEERS@STEPS, PEERS:diloco:H or PEERS:diloco-topk:H"

    def __init__(self, spec: str):
        parts = spec.split(":")
        try:
            peers, _, steps = parts[0].partition("@")
            self.peers, self.own_steps = int(peers), int(steps) if steps else None
            self.strategy = parts[1] if len(parts) > 1 else "sync"
            self.local_steps = int(parts[2]) if len(parts) > 2 else 1
            self.compression = "topk" if self.strategy == "diloco-topk" else "dense"
            self.strategy = "diloco" if self.compression == "topk" else self.strategy
        except (ValueError, IndexError):
            raise argparse.ArgumentTypeError(f"{spec!r}: {self.USAGE}") from None
        if self.strategy not in ("sync", "diloco") or (self.strategy == "sync") != (len(parts) == 1):
            raise argparse.ArgumentTypeError(f"{spec!r}: {self.USAGE}")

    @property
    def key(self) -> str:
        if self.strategy == "diloco":
            topk = "-topk" if self.compression == "topk" else ""
            return f"{self.peers}:diloco{topk}:{self.local_steps}"
        return f"{self.peers}@{self.own_steps}" if self.own_steps else str(self.peers)

    @property
    def label(self) -> str:
        peers = f"{self.peers} peer{'s' if self.peers > 1 else ''}"
        if self.strategy == "diloco":
            return f"{peers} DiLoCo{' topk' if self.compression == 'topk' else ''} H={self.local_steps}"
        steps = f", {self.own_steps} steps" if self.own_steps else ""
        return peers + (" sync" if self.peers > 1 else "") + steps

    def max_steps(self, steps: int) -> int:
        """Global steps (DiLoCo: rounds) that hold as many samples as ``steps`` synchronous steps."""
        if self.own_steps:
            return self.own_steps
        return steps // self.local_steps if self.strategy == "diloco" else steps

    def schedule(self, steps: int, value: int | None) -> int | None:
        """``--warmup-steps``/``--total-steps`` for this arm: scaled when it runs its own number of steps."""
        if value is None or not self.own_steps:
            return value
        return max(1, round(value * self.own_steps / steps))


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
    if not curve or curve[-1][1] < hi:
        return float("nan")
    samples = np.array([c[1] for c in curve], dtype=float)
    loss = np.array([c[2] for c in curve], dtype=float)
    return float(np.interp(np.linspace(lo, hi, points), samples, loss).mean())


def eval_curve(monitor_rows: list[dict], curve: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """(global step, cumulative swarm samples, held-out loss) from the evaluation records the monitor logged;
    the samples of a step are the swarm's at that step in its training curve (0 at step 0)."""
    samples = {0: 0, **{step: total for step, total, _ in curve}}
    points = {}
    for r in monitor_rows:
        if r.get("kind") == "eval" and r.get("eval_loss") is not None and r.get("step") in samples:
            points[r["step"]] = (r["step"], samples[r["step"]], r["eval_loss"])
    return [points[step] for step in sorted(points)]


class SwarmRun:
    """One arm and one seed: a monitor, then N trainers (and an evaluation peer) joining it, until the
    trainers reach the last step and the final state is evaluated, or the run's time limit."""

    def __init__(self, arm: Arm, seed: int, args, data: Path, root: Path, attempt: int = 0):
        self.arm, self.peers, self.seed, self.args, self.data = arm, arm.peers, seed, args, data
        self.attempt = attempt
        self.steps = arm.max_steps(args.steps)
        tag = arm.key.replace(":", "-")
        self.out = root / f"arm{tag}-seed{seed}" / f"attempt{attempt}"
        self.out.mkdir(parents=True)
        run_id = f"conv{tag}s{seed}a{attempt}"
        # swarm-wide settings, the same for every role; then timing settings only (they do not change what
        # is computed), generous so that averaging rounds succeed on a loaded machine
        self.common = ["--preset", args.preset, "--run-id", run_id, "--host-maddrs", LOCALHOST,
                       "--strategy", arm.strategy, "--max-seq-length", str(args.seq_length),
                       "--matchmaking-time", str(args.matchmaking_time),
                       "--averaging-timeout", str(args.averaging_timeout)]  # fmt: skip
        if arm.strategy == "diloco":
            self.common += ["--local-steps", str(arm.local_steps)]
            if arm.compression == "topk":
                self.common += ["--outer-compression", "topk"]
                for flag, value in (("--topk-density", args.topk_density), ("--topk-bits", args.topk_bits)):
                    if value is not None:
                        self.common += [flag, str(value)]
            for flag, value in (("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum)):
                if value is not None:
                    self.common += [flag, str(value)]
        schedule = {"--target-batch-size": args.target_batch_size,
                    "--warmup-steps": arm.schedule(args.steps, args.warmup_steps),
                    "--total-steps": arm.schedule(args.steps, args.total_steps)}  # fmt: skip
        for flag, value in schedule.items():
            if value is not None:
                self.common += [flag, str(value)]
        self.swarm = Swarm(self.out)
        self.started = time.monotonic()
        self.trainers_started = False
        self.trainers_done_at: float | None = None
        self.finished = False
        self.last_print = 0.0
        # with an evaluation peer the monitor keeps the swarm's state (it needs the dataset's tokenizer for
        # the model's shapes), so that the final state can still be downloaded once the trainers have left
        # (a first copy a quarter of the way in: trainers that are done wait for a monitor that serves one)
        keep = []
        if args.eval_every:
            keep = ["--dataset-path", str(data), "--save-every", str(max(1, self.steps // 4))]
        self.swarm.start(
            "monitor",
            ["monitor", *self.common, "--output-dir", str(self.out / "monitor"), "--refresh-period", "1",
             "--dashboard-port", "-1", "--torch-threads", "1", *keep],
            threads=1,
        )  # fmt: skip

    @property
    def name(self) -> str:
        return f"{self.arm.label}, seed {self.seed}"

    def rows(self) -> list[list[dict]]:
        return [read_jsonl(self.out / f"trainer{i}" / "metrics.jsonl") for i in range(self.peers)]

    def evaluated(self) -> int:
        """The newest global step the evaluation peer measured (-1: none)."""
        rows = read_jsonl(self.out / "monitor" / "metrics.jsonl")
        return max((r.get("step", -1) for r in rows if r.get("kind") == "eval"), default=-1)

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
            evaluated = f", evaluated {self.evaluated()}" if self.args.eval_every else ""
            print(f"  {self.name}: steps {steps}{evaluated} after {elapsed:.0f} s", flush=True)
            self.last_print = time.monotonic()
        trainers_done = all(self.swarm.procs[f"trainer{i}"].poll() is not None for i in range(self.peers))
        if self.swarm.procs["monitor"].poll() is not None:
            raise RuntimeError(f"the monitor stopped; see {self.out / 'monitor.log'}")
        if elapsed > self.args.run_limit:
            print(f"  {self.name}: time limit reached at steps {steps}", flush=True)
        elif min(steps) < self.steps and not trainers_done:
            return False
        elif self.args.eval_every and self.evaluated() < self.steps:
            # the trainers are done (or leaving): wait for the evaluation of the final state
            self.trainers_done_at = self.trainers_done_at or time.monotonic()
            if time.monotonic() - self.trainers_done_at < self.args.eval_wait:
                return False
            print(f"  {self.name}: the final state (step {self.steps}) was not evaluated", flush=True)
        self.finish()
        return True

    def _start_trainers(self, initial: list[str]) -> None:
        batch = []
        if self.args.per_device_train_batch_size:
            batch = ["--per-device-train-batch-size", str(self.args.per_device_train_batch_size)]
        for i in range(self.peers):
            self.swarm.start(
                f"trainer{i}",
                ["train", *self.common, "--initial-peers", *initial, "--dataset-path", str(self.data),
                 "--output-dir", str(self.out / f"trainer{i}"), "--seed", str(1000 * self.seed + i),
                 "--max-steps", str(self.steps), "--torch-threads", "1", "--statistics-expiration", "30",
                 *batch],
                threads=1,
            )  # fmt: skip
        if self.args.eval_every:
            self.swarm.start(
                "eval",
                ["eval", *self.common, "--initial-peers", *initial, "--dataset-path", str(self.data),
                 "--output-dir", str(self.out / "eval"), "--seed", "0", "--torch-threads", "1",
                 "--eval-every", str(self.args.eval_every), "--eval-batches", str(self.args.eval_batches),
                 "--statistics-expiration", "120"],
                threads=1,
            )  # fmt: skip
        self.trainers_started = True

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.seconds = time.monotonic() - self.started
            self.swarm.stop()

    def result(self) -> dict:
        monitor = read_jsonl(self.out / "monitor" / "metrics.jsonl")
        return run_result(self.arm, self.seed, self.rows(), self.steps, monitor, self.seconds)


def run_result(
    arm: Arm, seed: int, rows: list[list[dict]], steps: int, monitor: list[dict], seconds: float = 0.0
) -> dict:
    groups = [r.get("group_size", 1) for rs in rows for r in rs]
    curve = swarm_curve(rows)
    return {
        "arm": arm.key,
        "peers": arm.peers,
        "strategy": arm.strategy,
        "local_steps": arm.local_steps,
        "seed": seed,
        "steps": steps,
        "curve": curve,
        "eval": eval_curve(monitor, curve),
        "seconds": seconds,
        "max_group": max(groups, default=1),
        "mean_group": statistics.mean(groups) if groups else 1,
        "failed_rounds": sum(max((r.get("rounds_failed", 0) for r in rs), default=0) for rs in rows),
        "inner_steps": [max((r.get("inner_steps", 0) or 0 for r in rs), default=0) for rs in rows],
        # every trainer reached the last step: none died (e.g. killed for memory) or lagged behind
        "complete": all(max((r.get("step", 0) for r in rs), default=0) >= steps for rs in rows),
    }


def collect(folders: list[str], args) -> list[dict]:
    """Runs from the folders of earlier (possibly interrupted) invocations: for each arm and seed, the last
    attempt whose trainers all reached the last step."""
    found: dict[tuple[str, int], dict] = {}
    for folder in folders:
        for attempt in sorted(Path(folder).glob("arm*-seed*/attempt*")):
            tag, seed = attempt.parent.name[len("arm") :].rsplit("-seed", 1)
            arm = Arm(tag.replace("-", ":"))
            rows = [read_jsonl(t / "metrics.jsonl") for t in sorted(attempt.glob("trainer*")) if t.is_dir()]
            monitor = read_jsonl(attempt / "monitor" / "metrics.jsonl")
            result = run_result(arm, int(seed), rows, arm.max_steps(args.steps), monitor)
            if len(rows) == arm.peers and result["complete"]:
                found[arm.key, int(seed)] = result
    return sorted(found.values(), key=lambda r: (r["seed"], order(args, r)))


def order(args, run: dict) -> tuple:
    """Report order: by peers, sync first, then DiLoCo by H (whatever order the arms ran in)."""
    arm = Arm(run.get("arm", str(run["peers"])))
    return arm.peers, arm.strategy == "diloco", arm.local_steps, arm.own_steps or 0


def run_all(args, data: Path, root: Path) -> list[dict]:
    """The arms of a seed run side by side (``--parallel``), the seeds one after the other."""
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        queue = list(args.arms)
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
                        active.append(SwarmRun(run.arm, seed, args, data, root, attempt=run.attempt + 1))
                        continue
                    print(f"  {run.name}: done in {run.seconds:.0f} s", flush=True)
                    results.append(result)
                    if args.json:  # as they come: an interrupted invocation keeps its finished runs
                        Path(args.json).write_text(json.dumps(results))
        finally:
            for run in active:
                run.finish()
    return results


ARM_COLORS = {"1": "#222222", "2": "#2f6fde", "4": "#d9541e", "8": "#2a9d4b"}
DILOCO_COLORS = ["#2f6fde", "#2a9d4b", "#8e44ad", "#c79a00"]


def plot(runs: list[dict], path: Path, lo: float, hi: float, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    diloco = sorted({r["arm"] for r in runs if r.get("strategy") == "diloco"})
    colors = {**ARM_COLORS, **{key: DILOCO_COLORS[i % len(DILOCO_COLORS)] for i, key in enumerate(diloco)}}
    styles = ["-", "--", ":", "-."]
    held_out = any(r.get("eval") for r in runs)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    what = "MLM + SOP" if args.preset.startswith("albert") else "LM"
    batch = (
        f"target batch {args.target_batch_size}" if args.target_batch_size else "the preset's target batch"
    )
    for run in runs:
        if not run["curve"]:
            continue
        arm = Arm(run.get("arm", str(run["peers"])))
        style = dict(color=colors.get(arm.key, "#888888"), linewidth=1.4)
        line = styles[run["seed"] % len(styles)]
        label = f"{arm.label}, seed {run['seed']}"
        steps, samples, loss = zip(*run["curve"], strict=True)
        if held_out:
            if run.get("eval"):
                _, eval_samples, eval_loss = zip(*run["eval"], strict=True)
                ax.plot(eval_samples, eval_loss, line, marker=".", markersize=3, label=label, **style)
            ax2.plot(samples, loss, line, **style)
        else:
            ax.plot(samples, loss, line, label=label, **style)
            ax2.plot(steps, loss, line, **style)
    ax.set_xlabel("samples (swarm total)")
    if held_out:
        ax.set_ylabel(f"held-out loss ({what}, evaluation peer)")
        ax.set_title(f"{args.preset} on WikiText-2 valid, {batch}: held-out loss", fontsize=9)
        ax2.set_xlabel("samples (swarm total)")
        ax2.set_ylabel(f"training loss ({what})")
        ax2.axvspan(lo, hi, color="#999999", alpha=0.15, label="window of the final training loss")
        ax2.set_title("training loss of the same runs (trainers' batches)", fontsize=9)
        ax2.legend(fontsize=7)
    else:
        ax.axvspan(lo, hi, color="#999999", alpha=0.15, label="window of the final loss")
        ax.set_ylabel(f"training loss ({what})")
        ax.set_title(f"{args.preset} on WikiText-2 valid, {batch}: loss against samples", fontsize=9)
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4], help="synchronous arms (N peers)")
    ap.add_argument(
        "--arms", type=Arm, nargs="+", help="arms: PEERS (sync) or PEERS:diloco:H; replaces --peers"
    )
    ap.add_argument("--preset", default="albert-tiny", help="albert-tiny, gpt2-tiny, ...")
    ap.add_argument("--seq-length", type=int, default=128, help="tokens per example (prepare and train)")
    ap.add_argument(
        "--target-batch-size", type=int, help="samples per synchronous global step (the preset's)"
    )
    ap.add_argument("--per-device-train-batch-size", type=int, help="micro-batch of each peer (the preset's)")
    ap.add_argument("--warmup-steps", type=int, help="the schedule's warm-up (the preset's)")
    ap.add_argument("--total-steps", type=int, help="the schedule's length (the preset's)")
    ap.add_argument("--outer-lr", type=float, help="DiLoCo arms: the outer learning rate (cotrain's default)")
    ap.add_argument(
        "--outer-momentum", type=float, help="DiLoCo arms: the outer momentum (cotrain's default)"
    )
    ap.add_argument("--topk-density", type=float, help="topk arms: --topk-density (cotrain's default)")
    ap.add_argument("--topk-bits", type=int, help="topk arms: --topk-bits (cotrain's default)")
    ap.add_argument("--seeds", type=int, default=2, help="runs per arm, each with its own seed")
    ap.add_argument("--steps", type=int, default=20, help="synchronous global steps per run (DiLoCo: / H)")
    ap.add_argument(
        "--eval-every", type=float, default=0.0, help="seconds; > 0: an evaluation peer per swarm"
    )
    ap.add_argument("--eval-batches", type=int, default=32, help="held-out batches of 8 per evaluation")
    ap.add_argument("--eval-wait", type=float, default=180.0, help="seconds to wait for the final evaluation")
    ap.add_argument("--valid-fraction", type=float, default=0.02, help="held-out share of the documents")
    ap.add_argument("--data", help="a dataset prepared from WikiText-2 valid (default: prepare one)")
    ap.add_argument("--plot", default=str(REPO / "docs" / "convergence.png"))
    ap.add_argument("--parallel", type=int, default=3, help="swarms (arms of a seed) run at once")
    ap.add_argument("--matchmaking-time", type=float, default=5.0, help="seconds (a timing setting)")
    ap.add_argument("--averaging-timeout", type=float, default=60.0, help="seconds (a timing setting)")
    ap.add_argument("--run-limit", type=float, default=1200.0, help="seconds allowed per swarm")
    ap.add_argument("--limit", type=float, default=2400.0, help="stop everything after this many seconds")
    ap.add_argument("--retries", type=int, default=1, help="runs again a swarm whose trainer stopped early")
    ap.add_argument("--json", help="also write the runs (curves included) to this file (with --collect too)")
    ap.add_argument("--merge", nargs="+", help="report on runs saved with --json instead (later files win)")
    ap.add_argument("--collect", nargs="+", help="report on the run folders of earlier invocations instead")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed, first-seed + 1, ...")
    ap.add_argument("--quick", action="store_true", help="1 and 2 peers, 1 seed, 8 steps, no plot")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.peers, args.arms, args.seeds, args.steps, args.plot = [1, 2], None, 1, 8, ""
    args.arms = args.arms or [Arm(str(n)) for n in args.peers]
    for arm in args.arms:
        if arm.strategy == "diloco" and args.steps % arm.local_steps:
            ap.error(f"--steps {args.steps} is not a multiple of H = {arm.local_steps} ({arm.key})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.collect:
        runs = collect(args.collect, args)
        if args.json:  # to --merge with the runs of other invocations
            Path(args.json).write_text(json.dumps(runs))
        return finish(runs, args)
    if args.merge:
        merged = {}
        for name in args.merge:
            for run in json.loads(Path(name).read_text()):
                merged[run.get("arm", str(run["peers"])), run["seed"]] = run
        return finish(sorted(merged.values(), key=lambda r: (r["seed"], order(args, r))), args)
    if not WIKITEXT.exists():
        sys.exit(f"{WIKITEXT} not found")
    install_exit_handlers(args.limit)
    started = print_started()
    tmp = Path(tempfile.mkdtemp(prefix="cotrain-convergence-"))
    runs = []
    try:
        data = Path(args.data) if args.data else tmp / "data"
        if not args.data:
            print(
                f"preparing WikiText-2 valid with `cotrain prepare` (max length {args.seq_length})",
                flush=True,
            )
            prepare_wikitext(data, args)
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
        final = [e for e in r.get("eval", []) if e[0] >= r.get("steps", last_step)]
        r["held_out"] = final[-1][2] if final else float("nan")
        r["held_out_start"] = r["eval"][0][2] if r.get("eval") and r["eval"][0][0] == 0 else float("nan")
    if any(r.get("eval") for r in runs):
        report_held_out(runs, args, lo, hi)
    else:
        report(runs, args, lo, hi)
    if args.plot:
        plot(runs, Path(args.plot), lo, hi, args)
        print(f"plot: {args.plot}")


def by_arm(runs: list[dict], args) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: (order(args, r), r["seed"])):
        arms.setdefault(r.get("arm", str(r["peers"])), []).append(r)
    return arms


def gap(value: float, base: float) -> float:
    return (value - base) / base


def report_held_out(runs: list[dict], args, lo: float, hi: float) -> None:
    """The table of the held-out loss of each arm's final state, against the first arm and against the
    synchronous arm with as many peers."""
    arms = by_arm(runs, args)
    mean = {key: statistics.mean(r["held_out"] for r in rs) for key, rs in arms.items()}
    train = {key: statistics.mean(r["final"] for r in rs) for key, rs in arms.items()}
    first = next(iter(arms))
    starts = [r["held_out_start"] for r in runs if not math.isnan(r["held_out_start"])]
    print()
    if starts:
        print(f"held-out loss at step 0 (the initial weights): {statistics.mean(starts):.4f}")
    print(f"training loss: mean over samples {lo:.0f}-{hi:.0f} (the last quarter every run reached)")
    print()
    print(
        "| arm | global steps (rounds) | inner steps (most of a peer) | samples | averaging group (mean, max)"
        " | failed rounds | held-out loss per seed | mean | gap vs 1 peer | gap vs sync | seed-to-seed spread"
        " | training loss | its gap vs sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst, compared = 0.0, False
    for key, rs in arms.items():
        arm = Arm(key)
        finals = [r["held_out"] for r in rs]
        spread = (max(finals) - min(finals)) / mean[key]
        sync = str(arm.peers)
        vs_sync, train_vs_sync = "", ""
        if arm.strategy == "diloco" and sync in mean:
            g = gap(mean[key], mean[sync])
            worst, compared = g if math.isnan(g) else max(worst, abs(g)), True
            vs_sync, train_vs_sync = f"**{g:+.2%}**", f"{gap(train[key], train[sync]):+.2%}"
        steps = ", ".join(
            (str(r["curve"][-1][0]) if r["curve"] else "0")
            + ("" if r.get("complete", True) else " (a trainer died)")
            for r in rs
        )
        inner = ", ".join(str(max(r["inner_steps"])) for r in rs if r.get("inner_steps"))
        samples = ", ".join(str(r["curve"][-1][1]) if r["curve"] else "0" for r in rs)
        group = f"{statistics.mean(r['mean_group'] for r in rs):.2f}, {max(r['max_group'] for r in rs)}"
        print(
            f"| {arm.label} | {steps} | {inner if arm.strategy == 'diloco' else '-'} | {samples} | {group} "
            f"| {sum(r.get('failed_rounds', 0) for r in rs)} | {', '.join(f'{f:.4f}' for f in finals)} "
            f"| {mean[key]:.4f} | {gap(mean[key], mean[first]):+.2%} | {vs_sync or '-'} | {spread:.2%} "
            f"| {train[key]:.4f} | {train_vs_sync or '-'} |"
        )
    print()
    equal_samples(arms, runs)
    if starts:
        fall = gap(mean[first], statistics.mean(starts))
        print(f"{Arm(first).label}: held-out loss {fall:+.1%} from step 0 (learning shown if <= -25%)")
    if compared:
        met = worst <= DILOCO_GOAL  # False when a gap is NaN
        print(
            f"Goal: |DiLoCo - sync| <= {DILOCO_GOAL:.0%}: {'met' if met else 'NOT met'} (largest {worst:.2%})"
        )


def at_samples(run: dict, samples: float) -> float:
    """The run's held-out loss at ``samples``, linearly interpolated between its evaluations."""
    points = run.get("eval") or []
    if not points or points[-1][1] < samples:
        return float("nan")
    return float(np.interp(samples, [p[1] for p in points], [p[2] for p in points]))


def equal_samples(arms: dict[str, list[dict]], runs: list[dict]) -> None:
    """The held-out loss of every arm at the same sample count (the fewest any run reached, interpolated
    between evaluations): the arms' steps overshoot the target batch by different amounts."""
    reached = min((r["eval"][-1][1] for r in runs if not math.isnan(r["held_out"])), default=0)
    if not reached:
        return
    at = {key: statistics.mean(at_samples(r, reached) for r in rs) for key, rs in arms.items()}
    syncs = [key for key in arms if Arm(key).strategy == "sync" and Arm(key).peers > 1]
    print()
    print(
        f"held-out loss at {reached} samples (the fewest any run reached; interpolated between evaluations):"
    )
    print()
    print("| arm | per seed | mean | " + " | ".join(f"gap vs {Arm(k).label}" for k in syncs) + " |")
    print("|---|---|---|" + "---|" * len(syncs))
    for key, rs in arms.items():
        gaps = [f"{gap(at[key], at[k]):+.2%}" if k != key else "-" for k in syncs]
        per_seed = ", ".join(f"{at_samples(r, reached):.4f}" for r in rs)
        print(f"| {Arm(key).label} | {per_seed} | {at[key]:.4f} | " + " | ".join(gaps) + " |")


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
