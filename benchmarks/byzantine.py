"""Malicious peers: the held-out loss of swarms with attackers among their trainers, mean and centered-clip.

A tiny model (``--models``: ``albert-tiny`` and ``gpt2-tiny``) trains on WikiText-2's validation file,
prepared with ``cotrain prepare`` (``--seq-length`` tokens, ``--valid-fraction`` held out), in real swarms on
127.0.0.1 started as benchmarks/convergence.py starts them: a ``cotrain monitor`` as the first peer (it keeps
the swarm's state, so that the final one outlives the trainers), N ``cotrain train`` processes that stop at
``--steps`` global steps, and an evaluation peer (``cotrain eval``, seed 0: the same held-out batches in every
swarm) that measures the swarm's state every ``--eval-every`` seconds. A *setup* ``N:K`` (``--setups``) is N
trainers of which the last K attack: they run with ``COTRAIN_ATTACK=<attack>`` and
``COTRAIN_ATTACK_SCALE=--scale`` (cotrain.faults). For each model and setup the arms are:

- ``clean``: no attacker, ``--aggregation mean``;
- ``clean, centered-clip`` (``--cost``): no attacker, ``--aggregation centered-clip``, run side by side with
  ``clean``: what the defence costs an honest swarm in held-out loss and in samples/s;
- for each attack (``--attacks``): ``mean`` and ``centered-clip`` with the K attackers on (centered-clip also
  turns on the capped progress accounting).

Every arm runs the same global steps with the same seeds (trainer i's data order and masking, the initial
weights); its number is the evaluation peer's held-out loss of the final state. Reported per model, setup and
attack: the loss of each arm, each attacked arm against the clean one, and the share of the clean arm's
progress from the initial loss that it kept. Goals (issue 15): with centered-clip within 5% of the clean loss
for every gradient attack; with mean, sign flip and random direction clearly worse. The samples/s of the two
honest swarms (``--cost``): the sum over trainers of the samples they contributed per second between their
second and last global step. ``--allreduce`` also times the all-reduce of ALBERT-large's gradients with
centered-clip against the mean at n = 4 on namespaced 100 Mbit/s links (benchmarks/allreduce.py
``--aggregation both``; needs root).

    python benchmarks/byzantine.py --quick        # sign flip, 1 of 5 attacks, gpt2-tiny
    python benchmarks/byzantine.py [--models albert-tiny gpt2-tiny] [--setups 5:1 7:2] [--attacks ...] \\
        [--steps 30] [--cost] [--allreduce] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cotrain.faults import ATTACK, ATTACK_SCALE, ATTACKS, GRADIENT_ATTACKS  # noqa: E402
from lib.netns import TimeUp, install_exit_handlers, print_finished, print_started  # noqa: E402
from lib.roles import LOCALHOST, REPO, WIKITEXT, Swarm, prepare_wikitext, read_jsonl  # noqa: E402

CLIP_GOAL = 0.05  # centered-clip: |attacked - clean| / clean at most this for every gradient attack
CLEARLY_WORSE = 0.05  # mean: sign flip and random direction at least this much worse than clean
AGGREGATIONS = {"mean": "mean", "clip": "centered-clip"}


@dataclass(frozen=True)
class Arm:
    """One swarm: ``model``, ``trainers`` of which the last ``attackers`` run ``attack`` ("" for none),
    ``aggregation`` ("mean" or "clip")."""

    model: str
    trainers: int
    attackers: int
    attack: str
    aggregation: str

    @property
    def key(self) -> str:
        return f"{self.model}-{self.trainers}x{self.attackers}-{self.attack or 'clean'}-{self.aggregation}"

    @property
    def setup(self) -> str:
        return f"{self.trainers}:{self.attackers}"

    @property
    def label(self) -> str:
        what = f"{self.attack}, {self.attackers} of {self.trainers}" if self.attack else "clean"
        return f"{self.model}, {what}, {AGGREGATIONS[self.aggregation]}"


def setup_spec(text: str) -> tuple[int, int]:
    """``N:K``: N trainers of which K attack."""
    try:
        trainers, attackers = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give TRAINERS:ATTACKERS, e.g. 5:1") from None
    if not 0 < attackers < trainers:
        raise argparse.ArgumentTypeError(f"{text!r}: between 1 and TRAINERS - 1 attackers")
    return trainers, attackers


def arms_for(args) -> list[Arm]:
    """Every arm, in the order they run: per model and setup the clean arm (and its centered-clip twin with
    --cost, next to it so that the two run side by side), then the two arms of each attack."""
    arms = []
    for model in args.models:
        for trainers, attackers in args.setups:
            arms.append(Arm(model, trainers, attackers, "", "mean"))
            if args.cost:
                arms.append(Arm(model, trainers, attackers, "", "clip"))
            for attack in args.attacks:
                arms += [Arm(model, trainers, attackers, attack, agg) for agg in ("mean", "clip")]
    return arms


class AttackSwarm(Swarm):
    """lib.roles.Swarm whose processes may get environment variables of their own (the attackers')."""

    def start(self, name: str, args: list[str], threads: int, env: dict[str, str] | None = None) -> None:
        with patched_environ(env or {}):
            super().start(name, args, threads)


@contextlib.contextmanager
def patched_environ(values: dict[str, str]):
    """``os.environ`` with ``values`` for the duration (Swarm.start hands its children os.environ)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ArmRun:
    """One arm: a monitor, then the trainers (attackers included) and the evaluation peer joining it, until
    the final state has been evaluated or the arm's time limit."""

    def __init__(self, arm: Arm, args, data: Path, root: Path):
        self.arm, self.args, self.data = arm, args, data
        self.out = root / arm.key
        self.out.mkdir(parents=True)
        self.common = ["--preset", arm.model, "--run-id", f"byz-{arm.key}", "--host-maddrs", LOCALHOST,
                       "--max-seq-length", str(args.seq_length),
                       "--aggregation", AGGREGATIONS[arm.aggregation],
                       "--matchmaking-time", str(args.matchmaking_time),
                       "--averaging-timeout", str(args.averaging_timeout)]  # fmt: skip
        schedule = {"--target-batch-size": args.target_batch_size, "--warmup-steps": args.warmup_steps,
                    "--total-steps": args.total_steps}  # fmt: skip
        for flag, value in schedule.items():
            if value is not None:
                self.common += [flag, str(value)]
        self.swarm = AttackSwarm(self.out)
        self.started = time.monotonic()
        self.trainers_started = False
        self.done_at: float | None = None
        self.finished = False
        self.seconds = 0.0
        self.last_print = 0.0
        self.swarm.start(
            "monitor",
            ["monitor", *self.common, "--output-dir", str(self.out / "monitor"), "--refresh-period", "1",
             "--dashboard-port", "-1", "--torch-threads", "1", "--dataset-path", str(data),
             "--save-every", str(max(1, args.steps // 4))],
            threads=1,
            env={ATTACK: ""},  # the monitor and the evaluation peer are honest
        )  # fmt: skip

    def trainer_rows(self) -> list[list[dict]]:
        return [read_jsonl(self.out / f"trainer{i}" / "metrics.jsonl") for i in range(self.arm.trainers)]

    def evaluations(self) -> dict[int, float]:
        """Global step -> held-out loss, from the evaluation records the monitor logged."""
        rows = read_jsonl(self.out / "monitor" / "metrics.jsonl")
        return {
            r["step"]: r["eval_loss"]
            for r in rows
            if r.get("kind") == "eval" and r.get("eval_loss") is not None and "step" in r
        }

    def poll(self) -> bool:
        """Advance the arm; True once it is over."""
        if self.finished:
            return True
        elapsed = time.monotonic() - self.started
        if not self.trainers_started:
            peers_file = self.out / "monitor" / "initial_peers.txt"
            if peers_file.exists():
                self._start_peers([a for a in peers_file.read_text().split() if "/127.0.0.1/" in a])
            elif self.swarm.dead() or elapsed > 300:
                raise RuntimeError(f"the monitor did not start; see {self.out / 'monitor.log'}")
            return False
        self.swarm.remember_tree()
        if self.swarm.procs["monitor"].poll() is not None:
            raise RuntimeError(f"the monitor stopped; see {self.out / 'monitor.log'}")
        steps = [max((r.get("step", 0) for r in rows), default=0) for rows in self.trainer_rows()]
        evaluated = max(self.evaluations(), default=-1)
        if time.monotonic() - self.last_print > 30:
            print(
                f"  {self.arm.label}: steps {steps}, evaluated {evaluated} after {elapsed:.0f} s", flush=True
            )
            self.last_print = time.monotonic()
        names = [f"trainer{i}" for i in range(self.arm.trainers)]
        trainers_done = all(self.swarm.procs[n].poll() is not None for n in names)
        if elapsed > self.args.run_limit:
            print(f"  {self.arm.label}: time limit reached at steps {steps}", flush=True)
        elif evaluated >= self.args.steps:
            pass  # the final state was evaluated
        elif max(steps) < self.args.steps and not trainers_done:
            return False
        else:  # the trainers are done (or leaving): wait for the evaluation of the final state
            self.done_at = self.done_at or time.monotonic()
            if time.monotonic() - self.done_at < self.args.eval_wait:
                return False
            print(
                f"  {self.arm.label}: the final state (step {self.args.steps}) was not evaluated", flush=True
            )
        self.finish()
        return True

    def _start_peers(self, initial: list[str]) -> None:
        args, arm = self.args, self.arm
        batch = []
        if args.per_device_train_batch_size:
            batch = ["--per-device-train-batch-size", str(args.per_device_train_batch_size)]
        for i in range(arm.trainers):
            attacker = arm.attack and i >= arm.trainers - arm.attackers
            env = {ATTACK: arm.attack, ATTACK_SCALE: str(args.scale)} if attacker else {ATTACK: ""}
            self.swarm.start(
                f"trainer{i}",
                ["train", *self.common, "--initial-peers", *initial, "--dataset-path", str(self.data),
                 "--output-dir", str(self.out / f"trainer{i}"), "--seed", str(1000 * args.seed + i),
                 "--max-steps", str(args.steps), "--torch-threads", "1", "--statistics-expiration", "30",
                 *batch],
                threads=1,
                env=env,
            )  # fmt: skip
        self.swarm.start(
            "eval",
            ["eval", *self.common, "--initial-peers", *initial, "--dataset-path", str(self.data),
             "--output-dir", str(self.out / "eval"), "--seed", "0", "--torch-threads", "1",
             "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
             "--statistics-expiration", "120"],
            threads=1,
            env={ATTACK: ""},
        )  # fmt: skip
        self.trainers_started = True

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.seconds = time.monotonic() - self.started
            self.swarm.stop()

    def result(self) -> dict:
        evaluations = self.evaluations()
        rows = self.trainer_rows()
        final = [loss for step, loss in sorted(evaluations.items()) if step >= self.args.steps]
        groups = [r.get("group_size", 1) for rs in rows for r in rs]
        return {
            **asdict(self.arm),
            "key": self.arm.key,
            "steps": [max((r.get("step", 0) for r in rs), default=0) for rs in rows],
            "loss": final[-1] if final else float("nan"),
            # the newest evaluation, when the final state's is missing (an arm cut short)
            "last_evaluated": max(evaluations, default=-1),
            "initial_loss": evaluations.get(0, float("nan")),
            "evaluations": sorted(evaluations.items()),
            "samples": sum(max((r.get("contribution", 0) for r in rs), default=0) for rs in rows),
            "samples_per_second": throughput(rows),
            "mean_group": statistics.mean(groups) if groups else 1.0,
            "failed_rounds": sum(max((r.get("rounds_failed", 0) for r in rs), default=0) for rs in rows),
            "seconds": self.seconds,
        }


def throughput(rows: list[list[dict]]) -> float:
    """The swarm's samples/s: per trainer, the samples it contributed between its second and its last global
    step over the time between them, summed (the first step holds start-up and catching up)."""
    total = 0.0
    for rs in rows:
        points = sorted((r["step"], r["time"], r["contribution"]) for r in rs if "time" in r and "step" in r)
        if len(points) >= 3 and points[-1][1] > points[1][1]:
            total += (points[-1][2] - points[1][2]) / (points[-1][1] - points[1][1])
    return total


def run_all(arms: list[Arm], args, data: dict[str, Path], root: Path) -> list[dict]:
    """The arms, ``--parallel`` at a time, in order."""
    queue, active, results = list(arms), [], []
    try:
        while queue or active:
            while queue and len(active) < args.parallel:
                arm = queue.pop(0)
                active.append(ArmRun(arm, args, data[arm.model], root))
            time.sleep(1.0)
            for run in [r for r in active if r.poll()]:
                active.remove(run)
                result = run.result()
                print(
                    f"  {run.arm.label}: held-out loss {result['loss']:.4f} after {run.seconds:.0f} s",
                    flush=True,
                )
                results.append(result)
                if args.json:  # as they come: an interrupted invocation keeps its finished arms
                    Path(args.json).write_text(json.dumps(results))
    finally:
        for run in active:
            run.finish()
    return results


# --------------------------------------------------------------------------------------------------- report


def gap(value: float, base: float) -> float:
    return (value - base) / base


def kept(loss: float, clean: float, initial: float) -> float:
    """The share of the clean arm's progress from the initial loss that an arm kept (1: all of it)."""
    return (initial - loss) / (initial - clean) if initial - clean > 0 else float("nan")


def summaries(results: list[dict]) -> list[dict]:
    """Per model, setup and attack: the losses of the clean, mean and centered-clip arms."""
    by_key = {(r["model"], r["trainers"], r["attackers"], r["attack"], r["aggregation"]): r for r in results}
    out = []
    for (model, trainers, attackers, attack, aggregation), r in by_key.items():
        if not attack or aggregation != "mean":
            continue
        clean = by_key.get((model, trainers, attackers, "", "mean"))
        clip = by_key.get((model, trainers, attackers, attack, "clip"))
        if clean is None or clip is None:
            continue
        initial = [x["initial_loss"] for x in (clean, r, clip) if not math.isnan(x["initial_loss"])]
        out.append(
            {
                "model": model,
                "setup": f"{trainers}:{attackers}",
                "attack": attack,
                "initial": statistics.mean(initial) if initial else float("nan"),
                "clean": clean["loss"],
                "mean": r["loss"],
                "clip": clip["loss"],
                "shown": {"clean": shown(clean), "mean": shown(r), "clip": shown(clip)},
            }
        )
    return out


def shown(result: dict) -> str:
    """An arm's loss for the table; when its final state was not evaluated, its newest evaluation."""
    if not math.isnan(result["loss"]):
        return f"{result['loss']:.4f}"
    evaluations = dict(result.get("evaluations") or [])
    step = result.get("last_evaluated", -1)
    return f"not evaluated (step {step}: {evaluations[step]:.4f})" if step in evaluations else "not evaluated"


def report(results: list[dict], args) -> list[dict]:
    rows = summaries(results)
    if not rows:
        cost_table(results)
        return rows
    print()
    print(
        "| model | trainers:attackers | attack | initial loss | clean | mean | centered-clip | mean vs clean "
        "| centered-clip vs clean | progress kept: mean, centered-clip |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        print(
            f"| {s['model']} | {s['setup']} | {s['attack']} | {s['initial']:.4f} | {s['shown']['clean']} "
            f"| {s['shown']['mean']} | {s['shown']['clip']} | {gap(s['mean'], s['clean']):+.2%} "
            f"| **{gap(s['clip'], s['clean']):+.2%}** | {kept(s['mean'], s['clean'], s['initial']):.0%}, "
            f"{kept(s['clip'], s['clean'], s['initial']):.0%} |"
        )
    print()
    gradient = [s for s in rows if s["attack"] in GRADIENT_ATTACKS]
    if gradient:
        worst = max(abs(gap(s["clip"], s["clean"])) for s in gradient)
        met = worst <= CLIP_GOAL  # False when a loss is NaN
        print(
            f"Goal: centered-clip within {CLIP_GOAL:.0%} of the clean loss for every gradient attack: "
            f"{'met' if met else 'NOT met'} (largest gap {worst:.2%})"
        )
    shown = [s for s in rows if s["attack"] in ("sign-flip", "random-direction")]
    if shown:
        real = all(gap(s["mean"], s["clean"]) >= CLEARLY_WORSE for s in shown)
        print(
            f"Attack real: mean at least {CLEARLY_WORSE:.0%} worse than clean under sign flip and random "
            f"direction: {'yes' if real else 'NO'} "
            f"(smallest {min(gap(s['mean'], s['clean']) for s in shown):+.2%})"
        )
    cost_table(results)
    return rows


def cost_table(results: list[dict]) -> None:
    """The two honest swarms of --cost, side by side: held-out loss and samples/s."""
    pairs = {}
    for r in results:
        if not r["attack"]:
            pairs.setdefault((r["model"], r["trainers"]), {})[r["aggregation"]] = r
    pairs = {k: v for k, v in pairs.items() if len(v) == 2}
    if not pairs:
        return
    print()
    print(
        "| model | trainers | held-out loss: mean, centered-clip | samples/s: mean | centered-clip "
        "| centered-clip / mean |"
    )
    print("|---|---|---|---|---|---|")
    for (model, trainers), p in pairs.items():
        m, c = p["mean"], p["clip"]
        ratio = c["samples_per_second"] / m["samples_per_second"] if m["samples_per_second"] else float("nan")
        print(
            f"| {model} | {trainers} | {m['loss']:.4f}, {c['loss']:.4f} | {m['samples_per_second']:.1f} "
            f"| {c['samples_per_second']:.1f} | **{ratio:.3f}** |"
        )


def allreduce_argv(args) -> list[str]:
    """benchmarks/allreduce.py at n = 4, fp16, 100 Mbit/s, centered-clip and mean side by side."""
    return [sys.executable, str(Path(__file__).resolve().parent / "allreduce.py"), "--peers", "4",
            "--dtypes", "fp16", "--aggregation", "both", "--rounds", str(args.allreduce_rounds),
            "--exchanges", "0"]  # fmt: skip


def allreduce_cost(args) -> None:
    """The all-reduce time of centered-clip against mean (``allreduce_argv``)."""
    cmd = allreduce_argv(args)
    print(f"\nall-reduce cost: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=False, cwd=REPO)


def prepared(model: str, args, root: Path) -> Path:
    """WikiText-2 valid prepared for ``model`` (its objective and tokenizer), kept in --data-dir if given."""
    folder = root / f"{model}-{args.seq_length}"
    if not (folder / "manifest.json").exists():  # written last by `cotrain prepare`
        print(f"preparing WikiText-2 valid for {model} with `cotrain prepare` ({args.seq_length} tokens)")
        if folder.exists():
            shutil.rmtree(folder)
        ns = argparse.Namespace(preset=model, seq_length=args.seq_length, valid_fraction=args.valid_fraction)
        prepare_wikitext(folder, ns)
    return folder


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["albert-tiny", "gpt2-tiny"], help="presets to train")
    ap.add_argument(
        "--setups", nargs="+", type=setup_spec, default=[(5, 1), (7, 2)], help="TRAINERS:ATTACKERS"
    )
    ap.add_argument(
        "--attacks", nargs="*", choices=ATTACKS, default=list(ATTACKS), help="attacks to run (none: --cost)"
    )
    ap.add_argument("--scale", type=float, default=1000.0, help="COTRAIN_ATTACK_SCALE of the attackers")
    ap.add_argument("--steps", type=int, default=30, help="global steps of every arm")
    ap.add_argument("--seed", type=int, default=0, help="trainer i's seed is 1000 x seed + i in every arm")
    ap.add_argument("--seq-length", type=int, default=64, help="tokens per example (prepare and train)")
    ap.add_argument("--valid-fraction", type=float, default=0.05, help="held-out share of the documents")
    ap.add_argument("--target-batch-size", type=int, help="samples per global step (the preset's: 64)")
    ap.add_argument(
        "--per-device-train-batch-size", type=int, help="micro-batch of each trainer (the preset's)"
    )
    ap.add_argument("--warmup-steps", type=int, help="the schedule's warm-up (the preset's)")
    ap.add_argument("--total-steps", type=int, help="the schedule's length (the preset's)")
    ap.add_argument("--eval-every", type=float, default=15.0, help="seconds between evaluations")
    ap.add_argument("--eval-batches", type=int, default=16, help="held-out batches of 8 per evaluation")
    ap.add_argument("--eval-wait", type=float, default=120.0, help="seconds to wait for the final evaluation")
    ap.add_argument("--matchmaking-time", type=float, default=2.0, help="seconds (a timing setting)")
    ap.add_argument("--averaging-timeout", type=float, default=30.0, help="seconds (a timing setting)")
    ap.add_argument("--parallel", type=int, default=3, help="swarms run at once")
    ap.add_argument("--run-limit", type=float, default=900.0, help="seconds allowed per swarm")
    ap.add_argument("--limit", type=float, default=4 * 3600.0, help="stop everything after this many seconds")
    ap.add_argument("--cost", action="store_true", help="also an honest swarm with centered-clip (samples/s)")
    ap.add_argument("--allreduce", action="store_true", help="also the all-reduce time at n = 4 (root)")
    ap.add_argument("--allreduce-rounds", type=int, default=3, help="timed rounds per arm of --allreduce")
    ap.add_argument("--data-dir", help="keep prepared datasets here and reuse them (default: a temp folder)")
    ap.add_argument("--json", help="also write every arm's result to this file")
    ap.add_argument("--logs", help="keep every swarm's logs and metrics in this folder")
    ap.add_argument("--merge", nargs="+", help="report on arms saved with --json instead (later files win)")
    ap.add_argument("--quick", action="store_true", help="sign flip, 1 of 5 attacks, gpt2-tiny, 12 steps")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.setups, args.attacks, args.steps = ["gpt2-tiny"], [(5, 1)], ["sign-flip"], 12
        args.cost = args.allreduce = False
        args.parallel = 1  # three swarms of 7 roles at once thrash 2 cores; one after the other is faster
        args.run_limit = min(args.run_limit, 300.0)  # 7 roles of 12 steps take 140-200 s on 2 cores
        args.eval_every, args.eval_wait = 10.0, 60.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merged = {}
        for name in args.merge:
            for r in json.loads(Path(name).read_text()):
                merged[r["key"]] = r
        rows = report(list(merged.values()), args)
        print_summaries(rows, args)
        return
    if not WIKITEXT.exists():
        sys.exit(f"{WIKITEXT} not found")
    if args.logs and Path(args.logs).is_dir() and any(Path(args.logs).iterdir()):
        sys.exit(f"--logs {args.logs} is not empty (it holds an earlier run's swarms): give a new folder")
    install_exit_handlers(args.limit)
    started = print_started()
    tmp = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="cotrain-byzantine-"))
    tmp.mkdir(parents=True, exist_ok=True)
    arms = arms_for(args)
    print(
        f"{len(arms)} swarms: {', '.join(args.models)}; setups "
        f"{', '.join(f'{n}:{k}' for n, k in args.setups)}; attacks {', '.join(args.attacks)}; "
        f"{args.steps} global steps each, {args.parallel} at a time",
        flush=True,
    )
    try:
        data_root = Path(args.data_dir) if args.data_dir else tmp / "data"
        data_root.mkdir(parents=True, exist_ok=True)
        data = {model: prepared(model, args, data_root) for model in args.models}
        results = run_all(arms, args, data, tmp)
    except (BaseException, TimeUp):
        print(f"logs kept in {tmp}", file=sys.stderr)
        raise
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    rows = report(results, args)
    if args.allreduce:
        allreduce_cost(args)
    if any(math.isnan(r["loss"]) for r in results) and not args.logs:
        print(f"an arm's final state was not evaluated: logs kept in {tmp}")
    elif not args.logs:
        shutil.rmtree(tmp, ignore_errors=True)
    print_finished(started)
    print_summaries(rows, args)


def print_summaries(rows: list[dict], args) -> None:
    """One JSON line per attack (model and setup), the last lines of the output."""
    for s in rows:
        line = {"event": "byzantine_summary", "attack": s["attack"]}
        line.update(loss_clean=s["clean"], loss_mean=s["mean"], loss_clip=s["clip"])
        if not args.quick:
            line.update(model=s["model"], setup=s["setup"])
        print(json.dumps(line))


if __name__ == "__main__":
    main()
