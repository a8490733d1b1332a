"""Churn: a swarm that keeps losing machines and gaining new ones, on 127.0.0.1.

A monitor and N trainers (`cotrain monitor` / `cotrain train`, preset albert-tiny, a dataset made with
cotrain's prepare functions from the built-in corpus) train together. Once the swarm has taken its first
global step, every ~K seconds (K x 0.8-1.2) the driver kills a random trainer the way a machine vanishes:
SIGKILL to every process group of its process tree at once (supervisor, worker, hivemind's DHT process, its
p2pd daemon, averager processes), and starts a fresh trainer (new identity, seed and output folder). After
--duration seconds of churn it lets the newest trainers take their first step (at most --settle seconds, no
kills), reads `cotrain status --json`, stops every role with SIGTERM and reports:

- global steps done (in all, and during the churn), steps per minute;
- averaging rounds averaged and failed (the trainers' ``metrics.jsonl``), group sizes;
- peers that exited without being killed (must be 0);
- the loss trend from the monitor's ``metrics.jsonl`` (mean of the first and last steps: must fall);
- whether the newest checkpoint of the swarm's state (the monitor's, or a trainer's local one, as the
  monitor's download may time out on a loaded machine) holds only finite numbers;
- processes left behind once everything was stopped (every PID seen in any role's tree; must be 0);
- the monitor's memory (RSS of its process tree and of its worker) over the run.

    python benchmarks/chaos.py [--duration 180] [--trainers 4] [--kill-every 15] [--data DIR] [--json FILE]
                               [--strategy diloco --local-steps 2]

It prints a table and one JSON line, and exits 0 only if the invariants hold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.roles import LOCALHOST, demo_dataset, read_jsonl  # noqa: E402

RUN_ID = "chaos"
# timeouts shrunk as in the multi-peer tests: a global step takes seconds on 2 loaded cores
FAST = ["--matchmaking-time", "2", "--averaging-timeout", "10", "--torch-threads", "1",
        "--startup-timeout", "30"]  # fmt: skip
COMMON = ["--preset", "albert-tiny", "--run-id", RUN_ID, "--host-maddrs", LOCALHOST, *FAST]


def cotrain_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def _die_with_driver() -> None:
    """In a started role, before exec: SIGTERM when the driver dies, so a killed driver leaves nothing."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Peer:
    """A `cotrain` role started as a user would, in its own session like a terminal job."""

    def __init__(self, name: str, args: list[str], out: Path):
        self.name, self.out = name, out
        self.log_path = out.parent / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cotrain", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=cotrain_env(),
            start_new_session=True,
            preexec_fn=_die_with_driver if sys.platform == "linux" else None,
        )
        self.killed = False
        self.seen: set[int] = {self.proc.pid}

    def tree(self) -> list[psutil.Process]:
        """The supervisor, its descendants, and every process in their process groups."""
        procs: dict[int, psutil.Process] = {}
        try:
            root = psutil.Process(self.proc.pid)
            procs[root.pid] = root
            for child in root.children(recursive=True):
                procs[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        groups = set()
        for p in list(procs.values()):
            try:
                groups.add(os.getpgid(p.pid))
            except ProcessLookupError:
                pass
        for p in psutil.process_iter():
            try:
                if p.pid not in procs and os.getpgid(p.pid) in groups:
                    procs[p.pid] = p
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        self.seen.update(procs)
        return list(procs.values())

    def rss_mb(self) -> tuple[float, float]:
        """RSS of the whole tree and of the worker (the supervisor's child), in MiB."""
        total = worker = 0.0
        for p in self.tree():
            try:
                rss = p.memory_info().rss / 2**20
                total += rss
                if p.ppid() == self.proc.pid:
                    worker = rss
            except psutil.NoSuchProcess:
                pass
        return total, worker

    def vanish(self) -> None:
        """SIGKILL to every process group of the tree at once, as when the machine is switched off."""
        procs = self.tree()
        groups = set()
        for p in procs:
            try:
                groups.add(os.getpgid(p.pid))
            except ProcessLookupError:
                pass
        self.killed = True
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:  # any member that had left its group meanwhile
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.tree()
            self.proc.send_signal(signal.SIGTERM)

    def crashed(self) -> bool:
        return not self.killed and self.proc.poll() is not None

    def close(self) -> None:
        self._log.close()


def left_behind(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def final_parameters(folders: list[Path]) -> dict:
    """Whether the newest good checkpoint of the swarm's state (the monitor's, or a trainer's local one, as
    a download by the monitor may time out on a loaded machine) holds only finite numbers."""
    import torch

    from cotrain import checkpoints as ck

    found = [f for f in (ck.latest_good(d) for d in folders if d.exists()) if f is not None]
    if not found:
        return {"checkpoint": None, "checkpoint_step": None, "parameters_finite": None}
    path, meta = max(found, key=lambda f: int(f[1]["step"]))
    weights, optimizer = ck.read_tensors(path)
    tensors = [*weights.values(), *optimizer.values()]
    finite = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    return {"checkpoint": str(path), "checkpoint_step": int(meta["step"]), "parameters_finite": finite}


def swarm_status(initial: list[str], timeout: float) -> dict | None:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cotrain", *status_argv(initial)],
            capture_output=True, text=True, timeout=timeout, env=cotrain_env(),
        )  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return None


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return round(60 * sum((x - mx) * (y - my) for x, y in points) / var, 2) if var else None


def loss_trend(rows: list[dict], k: int = 3) -> dict:
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    if len(losses) < 2 * k:
        k = max(1, len(losses) // 2)
    if len(losses) < 2:
        return {"loss_first": None, "loss_last": None, "loss_falls": False}
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return {"loss_first": round(first, 4), "loss_last": round(last, 4), "loss_falls": last < first}


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out or tempfile.mkdtemp(prefix="cotrain-chaos-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    data = Path(args.data) if args.data else demo_dataset(out)
    load_start = os.getloadavg()
    peers: list[Peer] = []
    trainers: list[Peer] = []
    rss: list[tuple[float, float, float]] = []  # (seconds since churn start, tree MiB, worker MiB)
    kills = 0
    counter = iter(range(1, 10_000))

    def start_trainer(initial: list[str]) -> Peer:
        i = next(counter)
        name = f"trainer{i}"
        peer = Peer(name, trainer_argv(args, data, out, i, initial), out / name)
        peers.append(peer)
        trainers.append(peer)
        return peer

    monitor = Peer("monitor", monitor_argv(args, data, out), out / "monitor")
    peers.append(monitor)
    metrics = out / "monitor" / "metrics.jsonl"
    status, interrupted = None, None
    churn_start, churn_seconds = time.monotonic(), None
    step_at_start = step_at_end = 0
    try:
        peers_file = out / "monitor" / "initial_peers.txt"
        wait_for(peers_file.exists, args.startup_timeout, "the monitor's address")
        initial = peers_file.read_text().split()
        for _ in range(args.trainers):
            start_trainer(initial)
        wait_for(lambda: read_jsonl(metrics), args.startup_timeout, "the swarm's first global step")
        step_at_start = max(r["step"] for r in read_jsonl(metrics))
        churn_start = time.monotonic()
        next_kill = churn_start + args.kill_every * rng.uniform(0.8, 1.2)

        def sample(now: float) -> None:
            total, worker = monitor.rss_mb()
            rss.append((round(now - churn_start, 1), round(total, 1), round(worker, 1)))
            for p in peers:
                p.tree()  # remember every PID any role ever had, to look for leftovers at the end
            if monitor.proc.poll() is not None:
                raise RuntimeError("the monitor exited")

        while (now := time.monotonic()) < churn_start + args.duration:
            sample(now)
            if now >= next_kill:
                victim = rng.choice([t for t in trainers if t.proc.poll() is None and not t.killed])
                victim.vanish()
                kills += 1
                print(f"[{now - churn_start:5.0f} s] killed {victim.name}; a new trainer joins", flush=True)
                start_trainer(initial)
                next_kill = now + args.kill_every * rng.uniform(0.8, 1.2)
            time.sleep(1.0)
        churn_seconds = time.monotonic() - churn_start
        step_at_end = max((r["step"] for r in read_jsonl(metrics)), default=0)
        settle_end = time.monotonic() + args.settle  # no more kills: let the newest trainers take a step
        while (now := time.monotonic()) < settle_end and any(
            not read_jsonl(t.out / "metrics.jsonl") for t in trainers if not t.killed
        ):
            sample(now)
            time.sleep(1.0)
        status = swarm_status(initial, args.status_timeout) if args.status_timeout > 0 else None
    except (TimeoutError, KeyboardInterrupt, RuntimeError) as e:  # still stop everything and report
        interrupted = f"{type(e).__name__}: {e}"
    finally:
        if churn_seconds is None:
            churn_seconds = time.monotonic() - churn_start
            step_at_end = max((r["step"] for r in read_jsonl(metrics)), default=0)
        crashed = [p.name for p in peers if p.crashed()]
        for p in peers:
            p.stop()
        deadline = time.monotonic() + 30
        for p in peers:
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        seen = set().union(*(p.seen for p in peers))
        wait_deadline = time.monotonic() + 15  # the supervisors kill their groups within their grace period
        while left_behind(seen) and time.monotonic() < wait_deadline:
            time.sleep(0.5)
        leftovers = left_behind(seen)
        for pid in leftovers:  # leave the machine clean either way
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        unclean = [p.name for p in peers if not p.killed and p.proc.returncode not in (0, None)]
        for p in peers:
            p.close()

    rows = read_jsonl(metrics)
    last = {t.name: read_jsonl(t.out / "metrics.jsonl") for t in trainers}
    last_rows = [r[-1] for r in last.values() if r]
    replacements = trainers[args.trainers :]
    result = {
        "event": "chaos_summary",
        "interrupted": interrupted,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.machine()}",
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "trainers": args.trainers,
        "kill_every_s": args.kill_every,
        "churn_seconds": round(churn_seconds, 1),
        "kills": kills,
        "trainers_started": len(trainers),
        "replacements_that_took_a_step": sum(1 for t in replacements if last[t.name]),
        "replacements_killed_before_a_step": sum(1 for t in replacements if t.killed and not last[t.name]),
        "global_step": max((r["step"] for r in rows), default=0),
        "global_steps_during_churn": step_at_end - step_at_start,
        "steps_per_minute": round(60 * (step_at_end - step_at_start) / max(churn_seconds, 1), 2),
        "rounds_averaged": sum(r["rounds_averaged"] for r in last_rows),
        "rounds_failed": sum(r["rounds_failed"] for r in last_rows),
        "max_group_size": max((r["max_group_size"] for r in rows), default=0),
        "crashed_without_being_killed": crashed,
        "unclean_exits": unclean,
        **loss_trend(rows),
        **final_parameters([out / "monitor" / "checkpoints"] + [t.out / "checkpoints" for t in trainers]),
        "processes_left_behind": len(leftovers),
        "status_peers": status["num_peers"] if status else None,
        "status_global_step": status["global_step"] if status else None,
        "monitor_rss_mib": {
            "start": rss[0][1] if rss else None,
            "max": max((r[1] for r in rss), default=None),
            "end": rss[-1][1] if rss else None,
        },
        "monitor_rss_growth_mib_per_min": slope_per_minute([(t, tree) for t, tree, _ in rss]),
        "monitor_worker_rss_mib": {
            "start": rss[0][2] if rss else None,
            "max": max((r[2] for r in rss), default=None),
            "end": rss[-1][2] if rss else None,
        },
        "out": str(out),
    }
    result["ok"] = bool(
        not interrupted
        and not crashed
        and result["loss_falls"]
        and result["parameters_finite"]
        and not leftovers
        and result["global_steps_during_churn"] > 0
    )
    (out / "rss.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rss))
    return result


def table(r: dict) -> str:
    rss = "start {start}, max {max}, end {end}"
    rows = [
        ("churn", f"{r['churn_seconds']:.0f} s, {r['kills']} trainers killed, {r['trainers']} running"),
        ("global steps", f"{r['global_step']} ({r['global_steps_during_churn']} during churn, "
                         f"{r['steps_per_minute']}/min)"),
        ("averaging rounds", f"{r['rounds_averaged']} averaged, {r['rounds_failed']} failed"),
        ("replacements that took a step", f"{r['replacements_that_took_a_step']} of {r['kills']}"),
        ("crashed without being killed", f"{len(r['crashed_without_being_killed'])} (must be 0)"),
        ("loss (first -> last steps)", f"{r['loss_first']} -> {r['loss_last']} (must fall)"),
        ("final parameters finite", f"{r['parameters_finite']} (checkpoint of step {r['checkpoint_step']})"),
        ("processes left behind", f"{r['processes_left_behind']} (must be 0)"),
        ("monitor RSS, tree (MiB)", rss.format(**r["monitor_rss_mib"])
         + f", trend {r['monitor_rss_growth_mib_per_min']} MiB/min"),
        ("monitor RSS, worker (MiB)", rss.format(**r["monitor_worker_rss_mib"])),
        ("load average (1, 5, 15 min)", f"{r['load_average_start']} -> {r['load_average_end']}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def strategy_args(args: argparse.Namespace) -> list[str]:
    """The swarm's training strategy on the roles' command lines (diloco: with its local steps)."""
    if args.strategy == "sync":
        return []
    return ["--strategy", args.strategy, "--local-steps", str(args.local_steps)]


def monitor_argv(args: argparse.Namespace, data: Path, out: Path) -> list[str]:
    """The monitor: it keeps the state (checkpoints every ``--save-every`` global steps) and serves it."""
    return ["monitor", *COMMON, *strategy_args(args), "--output-dir", str(out / "monitor"),
            "--refresh-period", "1", "--dashboard-port", "-1", "--save-every", str(args.save_every),
            "--dataset-path", str(data)]  # fmt: skip


def trainer_argv(args: argparse.Namespace, data: Path, out: Path, i: int, initial: list[str]) -> list[str]:
    """Trainer ``i`` (its seed), joining through ``initial``."""
    return ["train", *COMMON, *strategy_args(args), "--initial-peers", *initial, "--dataset-path", str(data),
            "--seed", str(i), "--per-device-train-batch-size", "8", "--statistics-expiration", "20",
            "--save-steps", "3", "--save-total-limit", "1",
            "--output-dir", str(out / f"trainer{i}")]  # fmt: skip


def status_argv(initial: list[str]) -> list[str]:
    """`cotrain status` of the swarm, as JSON."""
    return ["status", "--run-id", RUN_ID, "--initial-peers", *initial, "--host-maddrs", LOCALHOST, "--json"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of churn (default 180)")
    parser.add_argument("--trainers", type=int, default=4, help="trainers running at any time (default 4)")
    parser.add_argument("--kill-every", type=float, default=15.0, help="mean seconds between kills")
    parser.add_argument("--save-every", type=int, default=4, help="global steps between monitor checkpoints")
    parser.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="at most this many seconds after the churn for the newest "
        "trainers to take their first step (no kills meanwhile)",
    )
    parser.add_argument(
        "--status-timeout", type=float, default=90.0, help="seconds for `cotrain status` (0: skip it)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=240.0, help="seconds allowed until the first global step"
    )
    parser.add_argument("--data", help="a prepared dataset (default: prepare the built-in corpus)")
    parser.add_argument("--out", help="folder for logs and metrics (default: a new temporary folder)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the choice of victims and kill times")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--strategy", choices=("sync", "diloco"), default="sync", help="the swarm's strategy")
    parser.add_argument("--local-steps", type=int, default=2, help="diloco: inner steps per outer round")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.trainers < 2:
        parser.error("--trainers must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def interrupt(signum, frame):  # SIGTERM/SIGHUP: stop every role in order, as on Ctrl+C
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    result = run(args)
    print(table(result))
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
