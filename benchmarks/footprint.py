"""Memory of a peer, process by process: a monitor and ``--trainers`` trainers of a small preset on 127.0.0.1.

Each role is a tree of processes: the supervisor the user started, its worker, the worker's forked children
(hivemind's DHT, with its libp2p daemon ``p2pd``; the averagers: a trainer's gradient and state averagers, the
monitor's state keeper), and, where tensors are shared through files in /dev/shm (hivemind's default, which
cotrain's peers replace by file descriptors: cotrain.host.shm), torch's ``torch_shm_manager``. Every
``--interval`` seconds each process's RSS, PSS and USS are sampled (psutil, from
/proc/PID/smaps): PSS counts a page shared by k processes as 1/k in each, so the PSS of a role's tree is
what it adds to the machine's memory beside the other peers; USS is what only that process holds (freed when
it exits). Shared libraries (torch's, most of all) are shared by every peer on the machine: the more peers,
the smaller each one's PSS. The roles run as ``benchmarks/convergence.py`` starts them (one CPU thread each,
and the two malloc arenas cotrain gives its workers unless ``MALLOC_ARENA_MAX`` is set: glibc's default
held a trainer 56 MiB larger).

The table is the median over the samples after ``--warmup`` seconds; growth compares the mean of the first and
the last quarter of those samples (a leak shows as steady growth). Last line: a JSON summary
``{"event": "footprint_summary", "trainer_pss_mib": ..., "monitor_pss_mib": ..., ...}``.

    python benchmarks/footprint.py [--preset albert-tiny] [--trainers 2] [--minutes 3] [--warmup 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import print_finished, print_started  # noqa: E402
from convergence import LOCALHOST, Swarm  # noqa: E402

GOALS_MIB = {"trainer": 600, "monitor": 300}  # PSS of a role's process tree
KINDS = ("supervisor", "worker", "dht", "p2pd", "averager", "torch_shm_manager", "other")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    name: str
    cmdline: tuple[str, ...]


def kinds(procs: list[Proc], root: int) -> dict[int, str]:
    """What each process of a role's tree is: the supervisor (``root``, ``python -m cotrain ROLE``), the
    worker (``-m cotrain._worker``), the worker's forked children (the same command line): the DHT is the one
    whose child is ``p2pd``, the others are averagers; then p2pd and torch's shm manager by name."""
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    out = {root: "supervisor"}
    workers = [p for p in children.get(root, []) if "cotrain._worker" in p.cmdline]
    for worker in workers:
        out[worker.pid] = "worker"
        for child in children.get(worker.pid, []):
            if child.name == "torch_shm_manager":
                out[child.pid] = "torch_shm_manager"
            elif child.cmdline == worker.cmdline:
                grandchildren = children.get(child.pid, [])
                out[child.pid] = "dht" if any(g.name == "p2pd" for g in grandchildren) else "averager"
    for p in procs:
        if p.name == "p2pd":
            out[p.pid] = "p2pd"
        out.setdefault(p.pid, "other")
    return out


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def sample(pid: int) -> list[dict]:
    """One sample of a role's tree: a row per process (MiB), with its kind."""
    rows, procs = [], []
    for p in tree(pid):
        try:
            with p.oneshot():
                info = Proc(p.pid, p.ppid(), p.name(), tuple(p.cmdline()))
                mem = p.memory_full_info()
        except psutil.Error:
            continue
        procs.append(info)
        rows.append({"pid": p.pid, "rss": mem.rss / 2**20, "pss": mem.pss / 2**20, "uss": mem.uss / 2**20,
                     **pss_split(p.pid)})  # fmt: skip
    kind = kinds(procs, pid)
    for row in rows:
        row["kind"] = kind[row["pid"]]
    return rows


def pss_split(pid: int) -> dict[str, float]:
    """A process's PSS by what backs it (MiB, from /proc/PID/smaps_rollup): ``pss_anon`` (its heap and
    anonymous mappings: allocator arenas, tensors), ``pss_file`` (libraries and other mapped files),
    ``pss_shmem`` (shared memory: tensors handed between processes through /dev/shm); empty where the kernel
    has no rollup."""
    fields = {"Pss_Anon:": "pss_anon", "Pss_File:": "pss_file", "Pss_Shmem:": "pss_shmem"}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in fields:
            out[fields[parts[0]]] = int(parts[1]) / 1024
    return out


def growth(values: list[float]) -> float:
    """Relative change from the mean of the first quarter of ``values`` to the mean of the last quarter."""
    quarter = max(1, len(values) // 4)
    first, last = statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])
    return (last - first) / first if first else 0.0


def summarize(samples: list[list[dict]]) -> dict:
    """Per process kind (summed over processes of that kind) and for the whole tree: the median MiB of each
    measure over the samples, the number of processes, and the growth of the tree's PSS."""
    out = {}
    for kind in (*KINDS, "total"):
        per = [[r for r in rows if kind in ("total", r["kind"])] for rows in samples]
        if not any(per):
            continue
        out[kind] = {
            measure: round(statistics.median(sum(r[measure] for r in rows) for rows in per), 1)
            for measure in ("rss", "pss", "uss")
        }
        out[kind]["processes"] = max(len(rows) for rows in per)
    out["total"]["pss_growth"] = round(growth([sum(r["pss"] for r in rows) for rows in samples]), 4)
    return out


def print_table(results: dict[str, dict]) -> None:
    print(f"\n{'role':10s} {'process':18s} {'n':>2s} {'RSS MiB':>8s} {'PSS MiB':>8s} {'USS MiB':>8s}")
    for role, table in results.items():
        for kind, row in table.items():
            print(
                f"{role:10s} {kind:18s} {row['processes']:2d} "
                f"{row['rss']:8.0f} {row['pss']:8.0f} {row['uss']:8.0f}"
            )
        print(f"{role:10s} {'PSS growth':18s} {100 * table['total']['pss_growth']:+.1f}%")


def prepare(data: Path, preset: str, seq_length: int) -> None:
    """The built-in demo corpus, prepared for ``preset`` with `cotrain prepare`."""
    cmd = [sys.executable, "-m", "cotrain", "prepare", "--preset", preset, "--demo-corpus",
           "--max-seq-length", str(seq_length), "--vocab-size", "4000", "--output", str(data)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)


def stopped_early(root: Path, names: list[str]) -> None:
    """Exit, showing the end of the logs of the roles that stopped (their folder is about to be removed)."""
    for name in names:
        log = root / f"{name}.log"
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        print(f"--- {name} stopped early; the end of its log:", *tail, sep="\n", file=sys.stderr)
    raise SystemExit(f"{', '.join(names)} stopped before the measurement ended")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=3.0, help="sampling time after the warm-up")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the first sample")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write the per-role tables here")
    args = ap.parse_args()
    started = print_started()
    with tempfile.TemporaryDirectory(prefix="cotrain-footprint-") as tmp:
        root = Path(tmp)
        data = root / "data"
        prepare(data, args.preset, args.seq_length)
        swarm = Swarm(root)
        common = ["--preset", args.preset, "--run-id", "footprint", "--host-maddrs", LOCALHOST,
                  "--max-seq-length", str(args.seq_length)]  # fmt: skip
        try:
            keeper = ["--dataset-path", str(data), "--save-every", "10", "--dashboard-port", "-1"]
            start_swarm(swarm, root, common, data, args.trainers, keeper)
            time.sleep(args.warmup)
            samples: dict[str, list[list[dict]]] = {name: [] for name in swarm.procs}
            end = time.monotonic() + 60 * args.minutes
            while time.monotonic() < end:
                if swarm.dead():
                    stopped_early(root, swarm.dead())
                for name, proc in swarm.procs.items():
                    samples[name].append(sample(proc.pid))
                time.sleep(args.interval)
        finally:
            swarm.stop()
    results = {name: summarize(rows) for name, rows in samples.items()}
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    trainers = [t["total"]["pss"] for name, t in results.items() if name != "monitor"]
    summary = {
        "event": "footprint_summary",
        "preset": args.preset,
        "trainers": args.trainers,
        "trainer_pss_mib": round(statistics.mean(trainers), 1),
        "trainer_uss_mib": round(
            statistics.mean(t["total"]["uss"] for n, t in results.items() if n != "monitor"), 1
        ),
        "monitor_pss_mib": results["monitor"]["total"]["pss"],
        "monitor_uss_mib": results["monitor"]["total"]["uss"],
        "max_pss_growth": max(t["total"]["pss_growth"] for t in results.values()),
        "goals_pss_mib": GOALS_MIB,
    }
    print_finished(started)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
