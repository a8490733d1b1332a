"""A slow peer in a DiLoCo swarm of sparse rounds: does its change count, does anyone wait for it, does it
make rounds carry the outer state?

A monitor and 3 trainers (``cotrain monitor`` / ``cotrain train``, preset ``--preset``, ``--strategy diloco
--outer-compression topk --local-steps H``, on 127.0.0.1, a dataset made from the built-in corpus) train for
``--rounds`` rounds, twice: all three at one speed, then with one of them held to ``--quota`` of a core
(a cgroup's CPU quota, ``cpu.cfs_quota_us``: this machine runs it as root). Per trainer, from its
metrics.jsonl (a row per round):

- rounds averaged with the others, rounds whose average it took after the others averaged without it
  (``rounds_caught_up``: its change goes into its next round), rounds failed (its change applied alone);
- samples it trained (the sum of its contributions);
- the longest and the median time between two of its rounds;
- rounds that carried the outer state (a round's payload ``round_bytes`` over 3 times the median: records
  are about 0.04 bytes a parameter, the outer state 4).

    python benchmarks/slow_peer.py [--rounds 8] [--quota 0.25] [--preset gpt2-tiny] [--local-steps 10]

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/cpu")
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def cotrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "cotrain", *args]


def run_settings(args) -> list[str]:
    return [
        "--preset", args.preset, "--run-id", "slow-peer", "--strategy", "diloco",
        "--outer-compression", "topk", "--local-steps", str(args.local_steps),
        "--target-batch-size", str(args.target_batch_size),
        "--max-seq-length", "128", "--matchmaking-time", str(args.matchmaking_time),
        "--averaging-timeout", str(args.averaging_timeout),
    ]  # fmt: skip


def monitor_args(args, out: Path) -> list[str]:
    return ["monitor", *run_settings(args), "--output-dir", str(out), "--host-maddrs", LOOPBACK,
            "--dashboard-port", "-1", "--refresh-period", "1"]  # fmt: skip


def trainer_args(args, i: int, initial: list[str], data: Path, out: Path) -> list[str]:
    """Trainer ``i`` (its seed), joining through ``initial``, for ``--rounds`` rounds."""
    return ["train", *run_settings(args), "--initial-peers", *initial, "--host-maddrs", LOOPBACK,
            "--dataset-path", str(data), "--seed", str(i), "--per-device-train-batch-size", "8",
            "--max-steps", str(args.rounds), "--output-dir", str(out), "--torch-threads", "1"]  # fmt: skip


def prepare_args(args, data: Path) -> list[str]:
    """The built-in demo corpus, prepared for ``--preset`` at 128 tokens."""
    return [
        "prepare",
        "--preset",
        args.preset,
        "--demo-corpus",
        "--max-seq-length",
        "128",
        "--output",
        str(data),
    ]


def throttled(command: list[str], group: Path | None) -> list[str]:
    """``command``, started inside the cgroup ``group`` (every process it starts stays in it)."""
    if group is None:
        return command
    quoted = " ".join(f"'{part}'" for part in command)
    return ["sh", "-c", f"echo $$ > {group / 'cgroup.procs'} && exec {quoted}"]


def rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trainer_figures(trained: list[dict]) -> dict:
    last = trained[-1] if trained else {}
    times = [r["time"] for r in trained]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    sizes = [r.get("round_bytes", 0) for r in trained if r.get("round_bytes")]
    median_bytes = statistics.median(sizes) if sizes else 0
    return {
        "rounds": len(trained),
        "averaged": last.get("rounds_averaged", 0),
        "caught_up": last.get("rounds_caught_up", 0),
        "failed": last.get("rounds_failed", 0),
        "samples": sum(r.get("contribution", 0) for r in trained),
        "longest_round_s": round(max(gaps), 1) if gaps else None,
        "median_round_s": round(statistics.median(gaps), 1) if gaps else None,
        "carried": sum(size > 3 * median_bytes for size in sizes),
        "median_round_bytes": median_bytes,
    }


def run_config(name: str, slow: bool, args, data: Path, work: Path) -> dict:
    """One swarm: a monitor and 3 trainers until every trainer reaches ``args.rounds`` (or the limit)."""
    group = None
    if slow:
        group = CGROUP / f"cotrain-slow-peer-{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(args.quota * 100000)))
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        monitor_dir = work / name / "monitor"
        monitor_dir.mkdir(parents=True)
        command = cotrain(*monitor_args(args, monitor_dir))
        logs.append(open(work / name / "monitor.log", "w"))
        procs.append(
            subprocess.Popen(command, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
        )
        peers_file = monitor_dir / "initial_peers.txt"
        deadline = time.monotonic() + 120
        while not peers_file.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"the monitor did not start; see {work / name / 'monitor.log'}")
            time.sleep(0.5)
        initial = peers_file.read_text().split()
        trainers = []
        for i in range(3):
            out = work / name / f"trainer{i}"
            command = cotrain(*trainer_args(args, i, initial, data, out))
            logs.append(open(work / name / f"trainer{i}.log", "w"))
            command = throttled(command, group if slow and i == args.slow_index else None)
            procs.append(
                subprocess.Popen(command, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
            )
            trainers.append((procs[-1], out))
        limit = time.monotonic() + args.limit
        while any(p.poll() is None for p, _ in trainers) and time.monotonic() < limit:
            time.sleep(1)
        timed_out = any(p.poll() is None for p, _ in trainers)
        figures = [trainer_figures(rows(out)) for _, out in trainers]
        return {"config": name, "timed_out": timed_out, "trainers": figures}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        if group is not None:
            for _ in range(20):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.5)


def print_table(results: list[dict], args) -> None:
    print()
    print(
        f"3 trainers of {args.preset}, DiLoCo with sparse rounds, H = {args.local_steps}, {args.rounds} "
        f"rounds, 127.0.0.1; 'slow': trainer {args.slow_index} held to {args.quota:g} of a core"
    )
    print()
    print("| config | trainer | rounds averaged | caught up | failed (alone) | samples trained "
          "| round s: median, longest | rounds that carried the outer state |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for result in results:
        for i, t in enumerate(result["trainers"]):
            mark = " (slow)" if result["config"] == "slow" and i == args.slow_index else ""
            late = " (timed out)" if result["timed_out"] else ""
            print(
                f"| {result['config']}{late} | {i}{mark} | {t['averaged']} | {t['caught_up']} "
                f"| {t['failed']} "
                f"| {t['samples']:,} | {t['median_round_s']}, {t['longest_round_s']} | {t['carried']} |"
            )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quota", type=float, default=0.25, help="the slow trainer's share of one core")
    ap.add_argument("--slow-index", type=int, default=2)
    ap.add_argument("--preset", default="gpt2-tiny")
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--target-batch-size", type=int, default=64)
    ap.add_argument("--matchmaking-time", type=float, default=2.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--limit", type=float, default=900.0, help="seconds a configuration may run")
    ap.add_argument("--only", choices=["even", "slow"], default=None)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not (CGROUP / "tasks").exists() or os.geteuid() != 0:
        sys.exit("slow_peer.py: needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="cotrain-slow-peer-"))
    try:
        data = work / "data"
        subprocess.run(cotrain(*prepare_args(args, data)), check=True, stdout=subprocess.DEVNULL)
        configs = [c for c in ("even", "slow") if args.only in (None, c)]
        results = [run_config(c, c == "slow", args, data, work) for c in configs]
        print_table(results, args)
        print(json.dumps({"rounds": args.rounds, "quota": args.quota, "results": results}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
