"""cotrain's own roles as processes on 127.0.0.1, for the benchmarks that run real swarms on one host.

- ``Swarm``: the roles of one run, each a ``python -m cotrain ROLE`` process started as a user would (one CPU
  thread each, dying with the benchmark), stopped trainers first, then the monitor; nothing of their process
  trees is left behind, nor their shared memory.
- ``start_swarm``: a monitor, then trainers joining it once it has written its address.
- ``read_jsonl`` reads a role's ``metrics.jsonl``; ``samples_per_second`` a trainer's speed from it.
- Datasets: ``prepare_wikitext`` (WikiText-2's validation file beside the repository, with `cotrain
  prepare`), ``prepare_demo`` (the built-in demo corpus, with `cotrain prepare`), ``demo_dataset`` (the same
  corpus at 128 tokens, prepared in this process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from cotrain.data import prepare_from_source
from lib.netns import die_with_parent, remove_shared_memory

REPO = Path(__file__).resolve().parents[2]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
LOCALHOST = "/ip4/127.0.0.1/tcp/0"


class Swarm:
    """A monitor and N trainers of one run, each a `cotrain` CLI process in a process group of its own."""

    def __init__(self, out: Path):
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        self.tree: set[int] = set()

    def start(self, name: str, args: list[str], threads: int) -> None:
        # malloc's arenas as cotrain sets them for its workers (cotrain.host.procs.worker_env)
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
        time.sleep(0.5)
        # torch's shared-memory tensors (hivemind's averagers) of processes killed here stay in /dev/shm, in
        # RAM, until removed: a few hundred MB per swarm, which add up over a benchmark on a small machine
        remove_shared_memory(sorted(self.tree))


def start_swarm(
    swarm: Swarm, root: Path, common: list[str], data: Path, trainers: int, monitor_extra: list[str]
) -> None:
    """Start a monitor (``common`` and ``monitor_extra`` on its command line), wait for its address, then
    ``trainers`` trainers joining it (micro-batches of 8, seeds 0, 1, ...; output in ``root``/t0, t1, ...)."""
    swarm.start(
        "monitor", ["monitor", *common, "--output-dir", str(root / "monitor"), *monitor_extra], threads=1
    )
    peers = root / "monitor" / "initial_peers.txt"
    deadline = time.monotonic() + 120
    while not peers.exists():
        if time.monotonic() > deadline or swarm.dead():
            stopped_early(root, ["monitor"])
        time.sleep(0.5)
    initial = peers.read_text().split()
    for i in range(trainers):
        trainer = ["train", *common, "--initial-peers", *initial, "--dataset-path", str(data),
                   "--output-dir", str(root / f"t{i}"), "--seed", str(i),
                   "--per-device-train-batch-size", "8"]  # fmt: skip
        swarm.start(f"trainer{i}", trainer, threads=1)


def stopped_early(root: Path, names: list[str]) -> None:
    """Exit, showing the end of the logs of the roles that stopped (their folder is about to be removed)."""
    for name in names:
        log = root / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        print(f"--- {name} stopped early; the end of its log:", *tail, sep="\n", file=sys.stderr)
    raise SystemExit(f"{', '.join(names)} stopped before the measurement ended")


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (a role's metrics), a line being written left out; none if absent."""
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written, or cut short when its role was killed
    return rows


def samples_per_second(rows: list[dict], t0: float, t1: float) -> float | None:
    """A trainer's samples/s over [t0, t1]: its contribution between the last row before t0 and the last
    row up to t1."""
    before = [r for r in rows if r["time"] < t0]
    inside = [r for r in rows if t0 <= r["time"] <= t1]
    if not before or not inside:
        return None
    start, end = before[-1], inside[-1]
    return (end["contribution"] - start["contribution"]) / (end["time"] - start["time"])


def prepare_wikitext(data: Path, args) -> None:
    """WikiText-2's validation file, prepared with `cotrain prepare` for ``args.preset`` (``args.seq_length``,
    ``args.valid_fraction``)."""
    cmd = [sys.executable, "-m", "cotrain", "prepare", "--preset", args.preset, "--text-files", str(WIKITEXT),
           "--output", str(data), "--max-seq-length", str(args.seq_length),
           "--valid-fraction", str(args.valid_fraction)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True, timeout=900)


def prepare_demo(data: Path, preset: str, seq_length: int) -> None:
    """The built-in demo corpus, prepared for ``preset`` with `cotrain prepare`."""
    cmd = [sys.executable, "-m", "cotrain", "prepare", "--preset", preset, "--demo-corpus",
           "--max-seq-length", str(seq_length), "--vocab-size", "4000", "--output", str(data)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)


def demo_dataset(out: Path) -> Path:
    """The built-in demo corpus at 128 tokens (the tiny presets' tokenizer of 4,000 words), prepared in this
    process into ``out``/data."""
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
