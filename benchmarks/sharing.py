"""Several trainers on one machine: their samples/s together against one trainer alone, with each trainer's
torch taking all the cores (oversubscribed) and with the cores shared out (cores // trainers threads each).

Each arm starts real `cotrain train` processes (preset albert-tiny, a dataset prepared from the built-in
corpus, 127.0.0.1 only). The trainers of an arm run at the same time but in runs of their own (no averaging
between them), so what is measured is the compute the machine gives them, not the network. Once every
trainer of the arm has taken its first global step, the driver measures for --duration seconds: a trainer's
samples/s is the growth of its ``contribution`` (samples it computed) between the rows of its metrics.jsonl
around that window, over their times. Every process started is stopped by its PID (SIGTERM to the
supervisor, then SIGKILL to whatever of its tree is left).

    python benchmarks/sharing.py [--trainers 2] [--duration 35] [--data DIR] [--auto]

The shared arm passes ``--torch-threads cores // trainers`` explicitly; with --auto it passes
``--torch-threads 0`` instead, to measure the trainer's own sharing (cotrain.cores.CoreShare). The
oversubscribed arm passes ``--torch-threads CORES`` (what torch takes by default). Goal: together >= 0.8x
alone.
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
from datetime import datetime, timezone
from pathlib import Path

import psutil

from cotrain.cores import machine_cores, share_of

LOCALHOST = "/ip4/127.0.0.1/tcp/0"
FIRST_STEP_TIMEOUT = 120.0


def prepare_data(out: Path) -> Path:
    from cotrain.data import prepare_from_source

    data = out / "data"
    prepare_from_source(
        demo=True,
        text_files=None,
        out_dir=data,
        max_length=128,
        seed=0,
        tokenizer_path=None,
        vocab_size=4000,
        progress=False,
    )
    return data


def read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    return rows


class Trainer:
    """One `cotrain train` process in a run of its own."""

    def __init__(self, name: str, threads: int, data: Path, work: Path, target: int) -> None:
        self.out = work / name
        self.out.mkdir(parents=True)
        args = ["train", "--preset", "albert-tiny", "--run-id", f"sharing-{name}", "--host-maddrs", LOCALHOST]
        args += ["--dataset-path", str(data), "--target-batch-size", str(target)]
        args += ["--per-device-train-batch-size", "8", "--devices", "cpu", "--torch-threads", str(threads)]
        args += ["--matchmaking-time", "2", "--averaging-timeout", "10", "--output-dir", str(self.out)]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.log = open(work / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cotrain", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pids: set[int] = {self.proc.pid}

    def rows(self) -> list[dict]:
        return read_rows(self.out / "metrics.jsonl")

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


def samples_per_second(rows: list[dict], t0: float, t1: float) -> float | None:
    """A trainer's samples/s over [t0, t1]: its contribution between the last row before t0 and the last
    row up to t1."""
    before = [r for r in rows if r["time"] < t0]
    inside = [r for r in rows if t0 <= r["time"] <= t1]
    if not before or not inside:
        return None
    start, end = before[-1], inside[-1]
    return (end["contribution"] - start["contribution"]) / (end["time"] - start["time"])


def measure(n: int, threads: int, data: Path, work: Path, duration: float, target: int) -> list[float | None]:
    """Start ``n`` trainers with ``threads`` torch threads each; their samples/s over ``duration`` seconds
    once all of them have taken a first step."""
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
        t0 = time.time()
        time.sleep(duration)
        t1 = time.time()
        time.sleep(min(10.0, duration / 3))  # the step in progress at t1 is not counted: its row comes later
        return [samples_per_second(t.rows(), t0, t1) for t in trainers]
    finally:
        for t in trainers:
            t.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2, help="trainers that run together (default: 2)")
    parser.add_argument("--duration", type=float, default=35.0, help="seconds measured per arm (default: 35)")
    parser.add_argument("--target-batch-size", type=int, default=32, help="samples per global step (32)")
    parser.add_argument("--data", type=Path, help="a prepared dataset (default: made from the demo corpus)")
    parser.add_argument("--auto", action="store_true", help="shared arm: --torch-threads 0 (CoreShare)")
    args = parser.parse_args(argv)
    cores = machine_cores()
    shared = 0 if args.auto else share_of(cores, args.trainers)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cotrain-sharing-") as tmp:
        work = Path(tmp)
        data = args.data or prepare_data(work)
        results = {}
        for mode, threads in (("oversubscribed", cores), ("shared", shared)):
            alone_threads = 0 if threads == 0 else cores  # one trainer alone takes every core either way
            alone = measure(
                1, alone_threads, data, work / f"{mode}-alone", args.duration, args.target_batch_size
            )
            together = measure(
                args.trainers, threads, data, work / f"{mode}-together", args.duration, args.target_batch_size
            )
            results[mode] = (threads, alone, together)
    host = f"{platform.node()}, {cores} cores, load average {os.getloadavg()[0]:.1f}"
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {host}, {time.monotonic() - started:.0f} s")
    print(f"{'torch threads per trainer':<32}{'alone':>10}{'together':>12}{'each':>22}{'together/alone':>16}")
    summary = {}
    for mode, (threads, alone, together) in results.items():
        shown = "0 (CoreShare)" if threads == 0 else str(threads)
        if None in alone or None in together:
            print(f"{mode + ': ' + shown:<32}  (no complete step in the window: raise --duration)")
            continue
        total = sum(together)
        ratio = total / alone[0]
        each = " + ".join(f"{x:.1f}" for x in together)
        print(f"{mode + ': ' + shown:<32}{alone[0]:>10.1f}{total:>12.1f}{each:>22}{ratio:>16.2f}")
        summary[mode] = {"threads": threads, "alone": alone[0], "together": together, "ratio": ratio}
    print(json.dumps({"cores": cores, "trainers": args.trainers, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
