"""CPU of a small swarm, process by process: where a machine's cores go, for source trees side by side.

A monitor and ``--trainers`` trainers of ``albert-tiny`` on 127.0.0.1 (the roles as ``footprint.py`` starts
them: one CPU thread each, micro-batches of 8, the demo corpus at sequence length 128), run from each source
tree given with ``--src`` in turn (``--repeats`` rounds, the trees alternating in each round so that a drift
of the machine falls on all of them). After ``--warmup`` seconds, each process's CPU time (user + system) over
``--seconds`` is summed by what the process is (a trainer's worker, its DHT process, its libp2p daemon, its
averager processes; the monitor's tree) and given per trainer in CPU-seconds per minute, beside the samples
per second the trainers trained in the same window (from their metrics: what the CPU bought).

    python benchmarks/swarm_cpu.py [--src OLD/src NEW/src] [--trainers 2] [--seconds 60] [--warmup 75]

A tree is a ``src`` folder holding a ``cotrain`` package (``git worktree add /tmp/old COMMIT`` gives one
of an older commit); it is put first on PYTHONPATH of every role. The last line is a JSON summary
``{"event": "swarm_cpu_summary", "trees": [{"src": ..., "cpu_per_min": {...}, "samples_per_s": ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import print_finished, print_started  # noqa: E402
from lib.procs import Proc, kinds, tree  # noqa: E402
from lib.roles import (  # noqa: E402  # noqa: E402
    LOCALHOST,
    REPO,
    Swarm,
    prepare_demo,
    read_jsonl,
    samples_per_second,
    start_swarm,
    stopped_early,
)

COMMON = ("--preset", "albert-tiny", "--run-id", "swarmcpu", "--host-maddrs", LOCALHOST,
          "--max-seq-length", "128")  # fmt: skip
ROWS = ("worker", "dht", "p2pd", "averager")  # a trainer's processes, as lib.procs.kinds names them


def cpu_by_process(pid: int) -> dict[int, tuple[str, float]]:
    """For each process of a role's tree: its kind and its CPU-seconds so far."""
    procs, times = [], {}
    for p in tree(pid):
        try:
            with p.oneshot():
                procs.append(Proc(p.pid, p.ppid(), p.name(), tuple(p.cmdline())))
                t = p.cpu_times()
                times[p.pid] = t.user + t.system
        except psutil.Error:
            continue
    kind = kinds(procs, pid)
    return {pid: (kind[pid], seconds) for pid, seconds in times.items()}


def run_once(src: Path, args, data: Path, root: Path) -> dict:
    """One swarm from the tree ``src``: CPU-seconds per minute by process kind, per trainer, and the
    trainers' samples/s, over the window."""
    os.environ["PYTHONPATH"] = str(src)
    swarm = Swarm(root)
    try:
        start_swarm(swarm, root, list(COMMON), data, args.trainers, ["--dashboard-port", "-1"])
        time.sleep(args.warmup)
        before = {name: cpu_by_process(p.pid) for name, p in swarm.procs.items()}
        t0 = time.time()
        time.sleep(args.seconds)
        after = {name: cpu_by_process(p.pid) for name, p in swarm.procs.items()}
        t1 = time.time()
        if swarm.dead():
            stopped_early(root, swarm.dead())
    finally:
        swarm.stop()
    per_min = 60.0 / (t1 - t0)
    cpu: dict[str, float] = {}
    for name, procs in after.items():
        for pid, (kind, seconds) in procs.items():
            used = seconds - before[name].get(pid, (kind, 0.0))[1]
            row = "monitor" if name == "monitor" else kind if kind in ROWS else "other"
            cpu[row] = cpu.get(row, 0.0) + used * per_min
    for row in (*ROWS, "other"):
        cpu[row] = cpu.get(row, 0.0) / args.trainers
    rates = [
        samples_per_second(read_jsonl(root / f"t{i}" / "metrics.jsonl"), t0, t1) for i in range(args.trainers)
    ]
    return {"cpu_per_min": cpu, "samples_per_s": sum(r or 0.0 for r in rates)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, nargs="+", default=[REPO / "src"], help="source trees to compare")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    ap.add_argument(
        "--warmup", type=float, default=75.0, help="seconds from the trainers' start to the window"
    )
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the trees")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = print_started()
    runs: dict[Path, list[dict]] = {src: [] for src in args.src}
    with tempfile.TemporaryDirectory(prefix="cotrain-swarmcpu-") as tmp:
        data = Path(tmp) / "data"
        prepare_demo(data, "albert-tiny", 128)
        for r in range(args.repeats):
            order = args.src if r % 2 == 0 else list(reversed(args.src))
            for src in order:
                root = Path(tmp) / f"r{r}-{len(runs[src])}-{abs(hash(src))}"
                root.mkdir()
                result = run_once(src, args, data, root)
                runs[src].append(result)
                print(f"round {r + 1}, {src}: {json.dumps(result)}", flush=True)
    rows = [*ROWS, "other", "monitor"]
    trees = []
    for src, results in runs.items():
        cpu = {row: statistics.mean(x["cpu_per_min"].get(row, 0.0) for x in results) for row in rows}
        rate = statistics.mean(x["samples_per_s"] for x in results)
        cpu = {k: round(v, 2) for k, v in cpu.items()}
        trees.append({"src": str(src), "cpu_per_min": cpu, "samples_per_s": round(rate, 2)})
    print(f"\nCPU-s per minute (per trainer; the monitor's whole tree), mean of {args.repeats} runs")
    print(f"{'process':22s}" + "".join(f"{'tree ' + str(i + 1):>12s}" for i in range(len(trees))))
    for row in rows:
        print(f"{row:22s}" + "".join(f"{t['cpu_per_min'][row]:12.1f}" for t in trees))
    print(f"{'samples/s (swarm)':22s}" + "".join(f"{t['samples_per_s']:12.1f}" for t in trees))
    for i, t in enumerate(trees):
        print(f"tree {i + 1}: {t['src']}")
    print_finished(started)
    print(json.dumps({"event": "swarm_cpu_summary", "trees": trees}))


if __name__ == "__main__":
    main()
