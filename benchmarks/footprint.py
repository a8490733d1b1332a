"""Memory of a peer, process by process: a monitor and ``--trainers`` trainers of a small preset on 127.0.0.1.

Each role is a tree of processes: the supervisor the user started, its worker, the worker's forked children
(hivemind's DHT, with its libp2p daemon ``p2pd``; the averagers: a trainer's gradient and state averagers, the
monitor's state keeper), and, where tensors are shared through files in /dev/shm (hivemind's default, which
cotrain's peers replace by file descriptors: cotrain.host.shm), torch's ``torch_shm_manager``. Every
``--interval`` seconds each process's RSS, PSS and USS are sampled (psutil, from
/proc/PID/smaps): PSS counts a page shared by k processes as 1/k in each, so the PSS of a role's tree is
what it adds to the machine's memory beside the other peers; USS is what only that process holds (freed when
it exits). Shared libraries (torch's, most of all) are shared by every peer on the machine: the more peers,
the smaller each one's PSS. The roles run as ``lib/roles.py`` starts them (one CPU thread each,
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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import print_finished, print_started  # noqa: E402
from lib.procs import KINDS, growth, sample  # noqa: E402
from lib.roles import LOCALHOST, Swarm, prepare_demo, start_swarm, stopped_early  # noqa: E402

GOALS_MIB = {"trainer": 600, "monitor": 300}  # PSS of a role's process tree


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


def common_args(args) -> list[str]:
    """What every role is given: the preset, the run, 127.0.0.1 and the sequence length."""
    return ["--preset", args.preset, "--run-id", "footprint", "--host-maddrs", LOCALHOST,
            "--max-seq-length", str(args.seq_length)]  # fmt: skip


def keeper_args(data: Path) -> list[str]:
    """The monitor's: checkpoints every 10 global steps, so it keeps and serves the state."""
    return ["--dataset-path", str(data), "--save-every", "10", "--dashboard-port", "-1"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=3.0, help="sampling time after the warm-up")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the first sample")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write the per-role tables here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = print_started()
    with tempfile.TemporaryDirectory(prefix="cotrain-footprint-") as tmp:
        root = Path(tmp)
        data = root / "data"
        prepare_demo(data, args.preset, args.seq_length)
        swarm = Swarm(root)
        try:
            start_swarm(swarm, root, common_args(args), data, args.trainers, keeper_args(data))
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
