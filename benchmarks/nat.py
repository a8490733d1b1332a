"""Behind NAT: a trainer on a home network joins a swarm through its router and averages with the others.

The hosts are network namespaces on one machine (``benchmarks/_netns.py``), links shaped to ``--rate`` Mbit/s
both ways: the monitor on ``h0``, a public trainer on ``h1``, and ``h2`` a home router that runs nothing of
cotrain: behind it a home host with a private address (10.214.0.2). The router masquerades what the home host
sends and forwards nothing that starts outside (nftables; no port forwarding, no UPnP): the home host dials
out and cannot be dialed, which the script checks with TCP before any peer starts.

For each way of joining (``--modes``) a fresh swarm (the monitor, the public trainer, the home trainer:
cotrain's own roles, ``albert-tiny`` on the built-in demo corpus, one CPU thread each) trains for
``--minutes``:

- ``client``: the home trainer with ``--client-mode --host-maddrs /ip4/127.0.0.1/tcp/0``, the command line of
  docs/deploy.md, section 4 (a client listens on nothing others can reach anyway);
- ``relay``: a full peer with ``--use-auto-relay``, reachable through a libp2p relay among the swarm's public
  peers (docs/deploy.md, section 5);
- ``plain``: a full peer with neither, as a volunteer who forgot the flag would join.

Reported per mode, from the trainers' OUTPUT_DIR/metrics.jsonl: whether the home trainer joined and when
(its first global step), its global steps and how many of them it averaged in a group of 2 (with the public
trainer), its rounds averaged and failed, the same for the public trainer, and the swarm's global steps.

    python benchmarks/nat.py [--modes client relay plain] [--minutes 3] [--rate 100] [--keep-logs]

Needs root, iproute2 and nftables (``apt-get install nftables``). The last line is
``{"event": "nat_summary", "modes": {"client": {"joined": ..., "averaged_share": ...}, ...}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _netns  # noqa: E402
from convergence import read_jsonl  # noqa: E402
from footprint import prepare  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MONITOR, PUBLIC, ROUTER = 0, 1, 2
MODES = {"client": ["--client-mode"], "relay": ["--use-auto-relay"], "plain": []}
LISTEN = {"client": "127.0.0.1"}  # the address a mode's home trainer listens on, if not its own


def trainer_summary(rows: list[dict], started: float) -> dict:
    """What a trainer's metrics lines say: its global steps, how many it averaged with another peer, its
    rounds averaged and failed (the last line's counters), and seconds from ``started`` (wall clock) to its
    first step."""
    steps = [r for r in rows if isinstance(r.get("step"), int) and "group_size" in r]
    if not steps:
        return {"joined": False, "steps": 0, "averaged": 0, "averaged_share": 0.0, "rounds_averaged": 0,
                "rounds_failed": 0, "first_step_s": None}  # fmt: skip
    averaged = sum(1 for r in steps if r["group_size"] >= 2)
    return {
        "joined": True,
        "steps": len(steps),
        "averaged": averaged,
        "averaged_share": round(averaged / len(steps), 3),
        "rounds_averaged": steps[-1].get("rounds_averaged", 0),
        "rounds_failed": steps[-1].get("rounds_failed", 0),
        "first_step_s": round(steps[0]["time"] - started, 1) if "time" in steps[0] else None,
    }


def run_mode(mode: str, args: argparse.Namespace, data: Path, root: Path) -> dict:
    """One swarm of the monitor, the public trainer and the home trainer (joined as ``mode`` says)."""
    out = root / mode
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    procs = []
    with _netns.Network(3, args.rate) as net:
        home = net.add_nat_host(ROUTER)
        reach = {
            "home_dials_out": _netns.tcp_connects(net, home, net.address(PUBLIC), PUBLIC),
            "dialed_at_private_address": _netns.tcp_connects(net, PUBLIC, net.address(home), home),
            "dialed_at_router_address": _netns.tcp_connects(net, PUBLIC, net.address(ROUTER), home),
        }
        if reach != {
            "home_dials_out": True,
            "dialed_at_private_address": False,
            "dialed_at_router_address": False,
        }:
            raise RuntimeError(f"the NAT does not behave as a home router: {reach}")

        def start(name: str, host: int, argv: list[str], listen: str = "") -> None:
            common = ["--preset", args.preset, "--run-id", f"nat-{mode}", "--max-seq-length", "128",
                      "--host-maddrs", f"/ip4/{listen or net.address(host)}/tcp/0", "--torch-threads", "1",
                      "--matchmaking-time", str(args.matchmaking_time),
                      "--averaging-timeout", str(args.averaging_timeout), "--dataset-path", str(data),
                      "--output-dir", str(out / name)]  # fmt: skip
            log = open(out / f"{name}.log", "w")
            argv = [sys.executable, "-m", "cotrain", *argv, *common]
            procs.append(_netns.start_in_ns(net, host, argv, stdout=log, stderr=log, env=env, cwd=REPO))

        try:
            start("monitor", MONITOR, ["monitor", "--dashboard-port", "-1", "--refresh-period", "2"])
            peers_file = out / "monitor" / "initial_peers.txt"
            deadline = time.monotonic() + 180
            while not peers_file.exists():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"the monitor did not start; see {out / 'monitor.log'}")
                time.sleep(0.5)
            initial = [a for a in peers_file.read_text().split() if f"/{net.address(MONITOR)}/" in a]
            started = time.time()
            trainers = (("public", PUBLIC, [], ""), ("home", home, MODES[mode], LISTEN.get(mode, "")))
            for name, host, extra, listen in trainers:
                start(name, host, ["train", "--initial-peers", *initial, "--per-device-train-batch-size", "8",
                                   "--seed", str(host), *extra], listen)  # fmt: skip
            end = time.monotonic() + args.minutes * 60
            while time.monotonic() < end and all(p.poll() is None for p in procs):
                time.sleep(2)
            names = ("monitor", "public", "home")
            crashed = [n for n, p in zip(names, procs, strict=True) if p.poll() is not None]
        finally:
            net.remember_pids()
            for proc in reversed(procs):  # the trainers first: the monitor serves them until they are gone
                _netns.stop_process(proc, grace=20)
    result = {
        "mode": mode,
        "flags": " ".join(MODES[mode]) or "(none)",
        "reach": reach,
        "crashed": crashed,
        "home": trainer_summary(read_jsonl(out / "home" / "metrics.jsonl"), started),
        "public": trainer_summary(read_jsonl(out / "public" / "metrics.jsonl"), started),
    }
    monitor_rows = read_jsonl(out / "monitor" / "metrics.jsonl")
    steps = [r["step"] for r in monitor_rows if isinstance(r.get("step"), int)]
    result["global_steps"] = max(steps, default=0)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--minutes", type=float, default=3.0, help="training time of each mode's swarm")
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of every link, each way")
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--keep-logs", action="store_true", help="keep the roles' logs and metrics")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    if not shutil.which("nft"):
        sys.exit("nat.py needs nftables for the home router's NAT: apt-get install nftables")
    _netns.prepare_namespaces("nat.py", limit_s=len(args.modes) * (args.minutes * 60 + 300) + 600)
    started = _netns.print_started()
    results = {}
    with _netns.logs_folder("cotrain-nat-", args.keep_logs) as root:
        data = root / "data"
        prepare(data, args.preset, 128)
        for mode in args.modes:
            print(f"{mode}: the home trainer joins with {' '.join(MODES[mode]) or 'no flag'}", flush=True)
            results[mode] = run_mode(mode, args, data, root)
            home, public = results[mode]["home"], results[mode]["public"]
            print(f"  home: {json.dumps(home)}\n  public: {json.dumps(public)}\n"
                  f"  global steps {results[mode]['global_steps']}, crashed {results[mode]['crashed']}",
                  flush=True)  # fmt: skip
    print(
        f"\n{'mode':8s} {'flags':18s} {'joined':>6s} {'first step s':>12s} {'home steps':>10s} "
        f"{'averaged (group 2)':>18s} {'rounds ok/failed':>16s} {'public averaged':>15s} "
        f"{'global steps':>12s}"
    )
    for mode, r in results.items():
        h, p = r["home"], r["public"]
        print(
            f"{mode:8s} {r['flags']:18s} {str(h['joined']):>6s} {h['first_step_s'] or '-':>12} "
            f"{h['steps']:>10d} "
            f"{h['averaged']:>10d} ({100 * h['averaged_share']:3.0f}%) "
            f"{h['rounds_averaged']:>8d}/{h['rounds_failed']:<7d} {p['averaged']:>6d} of {p['steps']:<5d} "
            f"{r['global_steps']:>12d}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    _netns.print_finished(started)
    summary = {
        "event": "nat_summary",
        "modes": {m: {"joined": r["home"]["joined"], "averaged_share": r["home"]["averaged_share"],
                      "global_steps": r["global_steps"]} for m, r in results.items()},
    }  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
