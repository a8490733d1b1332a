"""Several trainers on one machine: their samples/s together against one trainer alone, with each trainer's
torch taking all the cores (oversubscribed) and with the cores shared out (cores // trainers threads each).

Each arm starts real `cotrain train` processes (preset albert-tiny, a dataset prepared from the built-in
corpus, 127.0.0.1 only). The trainers of an arm run at the same time but in runs of their own (no averaging
between them), so what is measured is the compute the machine gives them, not the network. Once every
trainer of the arm has taken its first global step, the driver measures for --duration seconds: a trainer's
samples/s is the growth of its ``contribution`` (samples it computed) between the rows of its metrics.jsonl
around that window, over their times. Every process started is stopped by its PID (SIGTERM to the
supervisor, then SIGKILL to whatever of its tree is left).

    python benchmarks/sharing.py [--trainers 2] [--duration 30] [--data DIR] [--auto] [--idle-wait 20]

Arms, in this order: one trainer alone, the trainers together oversubscribed, the trainers together sharing,
one trainer alone again (the baseline is the lone run that other programs disturbed least). The
oversubscribed arm passes ``--torch-threads CORES`` (what torch takes by default); the shared arm passes
``--torch-threads cores // trainers`` explicitly, or with --auto ``--torch-threads 0`` (every arm then
relies on the trainer's own sharing, cotrain.host.cores.CoreShare). The machine may be shared: before each arm
the driver waits (at most --idle-wait s) for other programs to go quiet, and it reports the cores they used
during each window ("other load"). Goal: together (shared) >= 0.8x alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil

from cotrain.host.cores import machine_cores, share_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.roles import LOCALHOST, demo_dataset, read_jsonl, samples_per_second  # noqa: E402

FIRST_STEP_TIMEOUT = 120.0


def trainer_argv(name: str, threads: int, data: Path, out: Path, target: int) -> list[str]:
    """A `cotrain train` alone in its run (``sharing-NAME``) with ``threads`` torch threads (0: its share)."""
    args = ["train", "--preset", "albert-tiny", "--run-id", f"sharing-{name}", "--host-maddrs", LOCALHOST]
    args += ["--dataset-path", str(data), "--target-batch-size", str(target)]
    args += ["--per-device-train-batch-size", "8", "--devices", "cpu", "--torch-threads", str(threads)]
    args += ["--matchmaking-time", "2", "--averaging-timeout", "10", "--output-dir", str(out)]
    return args


class Trainer:
    """One `cotrain train` process in a run of its own."""

    def __init__(self, name: str, threads: int, data: Path, work: Path, target: int) -> None:
        self.out = work / name
        self.out.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.log = open(work / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cotrain", *trainer_argv(name, threads, data, self.out, target)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pids: set[int] = {self.proc.pid}

    def cpu_seconds(self) -> float:
        """CPU time of its process tree so far (user + system)."""
        self.remember_tree()
        total = 0.0
        for pid in self.pids:
            try:
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    def rows(self) -> list[dict]:
        return read_jsonl(self.out / "metrics.jsonl")

    def remember_tree(self) -> None:
        try:
            self.pids.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def stop(self, grace: float = 30.0) -> None:
        self.remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.pids:  # whatever of its tree is still there
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self.log.close()


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores, since boot)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def wait_idle(limit: float, threshold: float = 0.3) -> float:
    """Wait (at most ``limit`` s) until the machine's other programs use under ``threshold`` cores over 3 s;
    the load seen last."""
    deadline = time.monotonic() + limit
    while True:
        before = busy_seconds()
        time.sleep(3.0)
        load = (busy_seconds() - before) / 3.0
        if load < threshold or time.monotonic() > deadline:
            return load


def measure(
    n: int, threads: int, data: Path, work: Path, duration: float, target: int
) -> tuple[list[float | None], float]:
    """Start ``n`` trainers with ``threads`` torch threads each; their samples/s over ``duration`` seconds
    once all of them have taken a first step, and the cores other programs used meanwhile."""
    trainers = [Trainer(f"{work.name}-{i}", threads, data, work, target) for i in range(n)]
    try:
        deadline = time.monotonic() + FIRST_STEP_TIMEOUT
        while not all(t.rows() for t in trainers):
            for t in trainers:
                t.remember_tree()
                if t.proc.poll() is not None:
                    raise RuntimeError(f"a trainer exited early; see {t.log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no first step within {FIRST_STEP_TIMEOUT:.0f} s; see {work}")
            time.sleep(0.5)
        t0, busy0, own0 = time.time(), busy_seconds(), sum(t.cpu_seconds() for t in trainers)
        time.sleep(duration)
        t1, busy1, own1 = time.time(), busy_seconds(), sum(t.cpu_seconds() for t in trainers)
        other = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        deadline = (
            time.monotonic() + 20
        )  # the row of the step in progress at t1 (not counted) ends the window
        while time.monotonic() < deadline and not all(t.rows()[-1]["time"] > t1 for t in trainers):
            time.sleep(0.5)
        return [samples_per_second(t.rows(), t0, t1) for t in trainers], other
    finally:
        for t in trainers:
            t.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2, help="trainers that run together (default: 2)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured per arm (default: 30)")
    parser.add_argument("--target-batch-size", type=int, default=32, help="samples per global step (32)")
    parser.add_argument("--data", type=Path, help="a prepared dataset (default: made from the demo corpus)")
    parser.add_argument("--auto", action="store_true", help="shared arm: --torch-threads 0 (CoreShare)")
    parser.add_argument(
        "--idle-wait",
        type=float,
        default=20.0,
        help="seconds to wait at most for an idle machine before an arm",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cores = machine_cores()
    shared = 0 if args.auto else share_of(cores, args.trainers)
    alone_threads = 0 if args.auto else cores  # one trainer alone takes every core either way
    arms = [
        ("alone", 1, alone_threads),
        ("oversubscribed", args.trainers, cores),
        ("shared", args.trainers, shared),
        ("alone again", 1, alone_threads),
    ]
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="cotrain-sharing-") as tmp:
        work = Path(tmp)
        data = args.data or demo_dataset(work)
        for i, (name, n, threads) in enumerate(arms):
            wait_idle(args.idle_wait)
            speeds, other = measure(n, threads, data, work / f"arm{i}", args.duration, args.target_batch_size)
            results.append((name, n, threads, speeds, other))
    lone = [r for r in results if r[1] == 1 and None not in r[3]]
    baseline = sum(min(lone, key=lambda r: r[4])[3]) if lone else None  # the least disturbed lone run
    host = f"{platform.node()}, {cores} cores, python {platform.python_version()}"
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {host}, {time.monotonic() - started:.0f} s")
    print(f"{'arm':<16}{'trainers':>9}{'threads each':>14}{'samples/s':>11}{'each':>16}{'vs alone':>10}"
          f"{'other load':>12}")  # fmt: skip
    summary = []
    for name, n, threads, speeds, other in results:
        shown = "0 (auto)" if threads == 0 else str(threads)
        if None in speeds:
            print(f"{name:<16}{n:>9}{shown:>14}  no complete step in the window (raise --duration)")
            continue
        total = sum(speeds)
        ratio = total / baseline if baseline else float("nan")
        each = " + ".join(f"{x:.1f}" for x in speeds) if n > 1 else ""
        print(f"{name:<16}{n:>9}{shown:>14}{total:>11.1f}{each:>16}{ratio:>10.2f}{other:>12.2f}")
        summary.append({"arm": name, "trainers": n, "threads": threads, "samples_per_second": speeds,
                        "vs_alone": ratio, "other_load": other})  # fmt: skip
    print(json.dumps({"cores": cores, "baseline": baseline, "arms": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
