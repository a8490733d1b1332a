"""Behind NAT: a trainer on a home network joins a swarm through its router and averages with the others.

The hosts are network namespaces on one machine (``lib/netns.py``), links shaped to ``--rate`` Mbit/s
both ways: the monitor on ``h0``, a public trainer on ``h1``, and ``--homes`` home routers (2 by default) that
run nothing of cotrain, each with a home host behind it on a private network of its own (10.214.<k>.2). A
router masquerades what its home host sends and forwards nothing that starts outside (nftables; no port
forwarding, no UPnP): a home host dials out and cannot be dialed, by the public hosts or by the other home,
which the script checks with TCP before any peer starts. Two homes matter: one home trainer averaging with a
public one is carried by the connection the home trainer opened (libp2p streams go both ways over it); two
homes must also exchange parts with each other, and no connection between them can be opened directly.

For each way of joining (``--modes``) a fresh swarm (the monitor, the public trainer, the home trainers:
cotrain's own roles, ``albert-tiny`` on the built-in demo corpus, one CPU thread each) trains for
``--minutes``:

- ``client``: the home trainers with ``--client-mode --host-maddrs /ip4/127.0.0.1/tcp/0``, the command line of
  docs/deploy.md, section 4 (a client listens on nothing others can reach anyway);
- ``relay``: a full peer with ``--use-auto-relay``, reachable through a libp2p relay among the swarm's public
  peers (docs/deploy.md, section 5);
- ``plain``: no flag, as a volunteer who knows nothing about NAT joins: the trainer asks the monitor to dial
  it back, cannot be reached, and joins as a client by itself (cotrain.net.reachability).

The monitor reduces the clients' parts as an auxiliary peer (cotrain.hivemind_ext.auxiliary).
``--no-public-trainer`` leaves the public trainer out: the monitor is then the swarm's only public machine,
the usual volunteer set-up (one small cloud VM). ``--strategy diloco`` trains with DiLoCo (2 local steps per
round).

Reported per mode and trainer, from the trainers' OUTPUT_DIR/metrics.jsonl: whether it joined and when (its
first global step), its global steps and how many of them it averaged with every trainer (a group of all
of them) and with at least one other, its rounds averaged and failed; and the swarm's global steps.

    python benchmarks/nat.py [--modes client relay plain] [--homes 2] [--minutes 3] [--rate 100]
        [--strategy sync|diloco] [--no-public-trainer] [--keep-logs]

Needs root, iproute2 and nftables (``apt-get install nftables``). The last line is
``{"event": "nat_summary", "modes": {"client": {"joined": ..., "with_all_share": ...}, ...}}`` (the home
trainers' lowest share of steps averaged with every trainer).
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
from lib import netns  # noqa: E402
from lib.roles import prepare_demo, read_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MONITOR, PUBLIC = 0, 1  # the home routers are the hosts after them
MODES = {"client": ["--client-mode"], "relay": ["--use-auto-relay"], "plain": []}
LISTEN = {"client": "127.0.0.1"}  # the address a mode's home trainer listens on, if not its own


def trainer_summary(
    rows: list[dict], started: float, everyone: int, window: tuple[float, float] | None = None
) -> dict:
    """What a trainer's metrics lines say: its global steps, how many it averaged with another peer and with
    ``everyone`` (a group of every trainer), its rounds averaged and failed (the last line's counters), and
    seconds from ``started`` (wall clock) to its first step. With a ``window`` (wall clock: from the last
    trainer's first step to the first trainer's stop), also its steps within it and the share of them it
    averaged with everyone: the steps it took while every trainer was training."""
    steps = [r for r in rows if isinstance(r.get("step"), int) and "group_size" in r]
    if not steps:
        return {"joined": False, "steps": 0, "averaged": 0, "with_all": 0, "with_all_share": 0.0,
                "rounds_averaged": 0, "rounds_failed": 0, "first_step_s": None}  # fmt: skip
    with_all = sum(1 for r in steps if r["group_size"] >= everyone)
    out = {
        "joined": True,
        "steps": len(steps),
        "averaged": sum(1 for r in steps if r["group_size"] >= 2),
        "with_all": with_all,
        "with_all_share": round(with_all / len(steps), 3),
        "rounds_averaged": steps[-1].get("rounds_averaged", 0),
        "rounds_failed": steps[-1].get("rounds_failed", 0),
        "first_step_s": round(steps[0]["time"] - started, 1) if "time" in steps[0] else None,
    }
    if window is not None:
        inside = [r for r in steps if window[0] <= r.get("time", -1.0) <= window[1]]
        out["steps_while_all"] = len(inside)
        together = sum(1 for r in inside if r["group_size"] >= everyone)
        out["with_all_while_all_share"] = round(together / len(inside), 3) if inside else 0.0
        before = [r for r in steps if r.get("time", -1.0) < window[0]]  # the counters as the window opened
        base = before[-1].get("rounds_failed", 0) if before else 0
        out["rounds_failed_while_all"] = inside[-1].get("rounds_failed", 0) - base if inside else 0
    return out


def _said(log: Path, what: str = "joining as a client") -> str:
    """The first line of a role's log that says ``what`` (the reachability probe's verdict, the monitor's
    count of the rounds it reduced), from ``what`` on; "" when none does."""
    if not log.exists():
        return ""
    for line in log.read_text(errors="replace").splitlines():
        if what in line:
            return line[line.index(what) - (0 if what == "Reduced " else 60) :][:200].strip()
    return ""


def nat_reach(net: netns.Network, homes: list[int]) -> dict:
    """TCP checks of the NAT before any peer starts: each home host reaches the public trainer's host, and
    nobody reaches a home host, at its private address or at its router's (raises otherwise)."""
    reach = {}
    for k, home in enumerate(homes):
        router = home - len(homes)  # add_nat_host numbers the homes after the hosts, in the routers' order
        reach[f"home{k}_dials_out"] = netns.tcp_connects(net, home, net.address(PUBLIC), PUBLIC)
        reach[f"home{k}_dialed_at_router"] = netns.tcp_connects(net, PUBLIC, net.address(router), home)
        for src in [PUBLIC, *(h for h in homes if h != home)]:
            reach[f"home{k}_dialed_from_h{src}"] = netns.tcp_connects(net, src, net.address(home), home)
    if any(v != key.endswith("dials_out") for key, v in reach.items()):
        raise RuntimeError(f"the NAT does not behave as a home router: {reach}")
    return reach


def strategy_args(args: argparse.Namespace) -> list[str]:
    """The swarm's strategy on every role's command line (DiLoCo: 2 local steps per round)."""
    return ["--strategy", args.strategy, *(["--local-steps", "2"] if args.strategy == "diloco" else [])]


def monitor_args(args: argparse.Namespace) -> list[str]:
    return ["monitor", "--dashboard-port", "-1", "--refresh-period", "2", *strategy_args(args)]


def trainer_args(args: argparse.Namespace, initial: list[str], host: int, extra: list[str]) -> list[str]:
    """A trainer on ``host`` (its seed), joining through ``initial``, with ``extra`` (a mode's flags)."""
    return ["train", "--initial-peers", *initial, "--per-device-train-batch-size", "8", "--seed", str(host),
            *strategy_args(args), *extra]  # fmt: skip


def role_argv(
    role: list[str], mode: str, args: argparse.Namespace, data: Path, out: Path, address: str
) -> list[str]:
    """``role`` (``monitor_args``, ``trainer_args``) with what every role of a mode's swarm is given: the
    preset, the run, the timing settings, the dataset, its output folder ``out`` and the address it listens
    on."""
    return [*role, "--preset", args.preset, "--run-id", f"nat-{mode}", "--max-seq-length", "128",
            "--host-maddrs", f"/ip4/{address}/tcp/0", "--torch-threads", "1",
            "--matchmaking-time", str(args.matchmaking_time),
            "--averaging-timeout", str(args.averaging_timeout),
            "--dataset-path", str(data), "--output-dir", str(out)]  # fmt: skip


def run_mode(mode: str, args: argparse.Namespace, data: Path, root: Path) -> dict:
    """One swarm of the monitor, the public trainer and the home trainers (joined as ``mode`` says)."""
    out = root / mode
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    procs = []
    with netns.Network(2 + args.homes, args.rate) as net:
        homes = [net.add_nat_host(router) for router in range(2, 2 + args.homes)]
        reach = nat_reach(net, homes)

        def start(name: str, host: int, role: list[str], listen: str = "") -> None:
            log = open(out / f"{name}.log", "w")
            address = listen or net.address(host)
            argv = [sys.executable, "-m", "cotrain", *role_argv(role, mode, args, data, out / name, address)]
            procs.append(netns.start_in_ns(net, host, argv, stdout=log, stderr=log, env=env, cwd=REPO))

        try:
            start("monitor", MONITOR, monitor_args(args))
            peers_file = out / "monitor" / "initial_peers.txt"
            deadline = time.monotonic() + 180
            while not peers_file.exists():
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"the monitor did not start; see {out / 'monitor.log'}")
                time.sleep(0.5)
            initial = [a for a in peers_file.read_text().split() if f"/{net.address(MONITOR)}/" in a]
            started = time.time()
            trainers = [("public", PUBLIC, [], "")] if args.public_trainer else []
            trainers += [(f"home{k}", h, MODES[mode], LISTEN.get(mode, "")) for k, h in enumerate(homes)]
            for name, host, extra, listen in trainers:
                start(name, host, trainer_args(args, initial, host, extra), listen)
            end = time.monotonic() + args.minutes * 60
            while time.monotonic() < end and all(p.poll() is None for p in procs):
                time.sleep(2)
            names = ["monitor", *(t[0] for t in trainers)]
            crashed = [n for n, p in zip(names, procs, strict=True) if p.poll() is not None]
            stopping_at = time.time()
        finally:
            net.remember_pids()
            for proc in reversed(procs):  # the trainers first: the monitor serves them until they are gone
                netns.stop_process(proc, grace=20)
    said = {name: _said(out / f"{name}.log") for name, *_ in trainers}
    rows = {name: read_jsonl(out / name / "metrics.jsonl") for name, *_ in trainers}
    firsts = [
        min((r["time"] for r in rs if "group_size" in r and "time" in r), default=None)
        for rs in rows.values()
    ]
    window = (max(firsts), stopping_at) if firsts and None not in firsts else None
    result = {
        "mode": mode,
        "strategy": args.strategy,
        "flags": " ".join(MODES[mode]) or "(none)",
        "said": said,
        "monitor_reduced": _said(out / "monitor.log", "Reduced "),
        "reach": reach,
        "crashed": crashed,
        "trainers": {
            name: trainer_summary(rows[name], started, len(trainers), window) for name, *_ in trainers
        },
    }
    monitor_rows = read_jsonl(out / "monitor" / "metrics.jsonl")
    steps = [r["step"] for r in monitor_rows if isinstance(r.get("step"), int)]
    result["global_steps"] = max(steps, default=0)
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--homes", type=int, default=2, help="home trainers, each behind a NAT of its own")
    ap.add_argument("--minutes", type=float, default=3.0, help="training time of each mode's swarm")
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of every link, each way")
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--strategy", choices=["sync", "diloco"], default="sync")
    ap.add_argument(
        "--public-trainer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a trainer on a public host beside the home ones (--no-public-trainer: the monitor is the "
        "swarm's only public machine, as in a volunteer swarm of one cloud VM)",
    )
    ap.add_argument("--keep-logs", action="store_true", help="keep the roles' logs and metrics")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not 1 <= args.homes <= 8:
        ap.error("--homes must be between 1 and 8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shutil.which("nft"):
        sys.exit("nat.py needs nftables for the home router's NAT: apt-get install nftables")
    netns.prepare_namespaces("nat.py", limit_s=len(args.modes) * (args.minutes * 60 + 300) + 600)
    started = netns.print_started()
    results = {}
    with netns.logs_folder("cotrain-nat-", args.keep_logs) as root:
        data = root / "data"
        prepare_demo(data, args.preset, 128)
        for mode in args.modes:
            print(f"{mode}: the home trainers join with {' '.join(MODES[mode]) or 'no flag'}", flush=True)
            results[mode] = run_mode(mode, args, data, root)
            for name, t in results[mode]["trainers"].items():
                print(f"  {name}: {json.dumps(t)}", flush=True)
                if results[mode]["said"].get(name):
                    print(f"    said: {results[mode]['said'][name]}", flush=True)
            print(f"  monitor: {results[mode]['monitor_reduced'] or 'reduced nothing'}", flush=True)
            print(
                f"  global steps {results[mode]['global_steps']}, crashed {results[mode]['crashed']}",
                flush=True,
            )
    print(
        f"\n{'mode':8s} {'trainer':8s} {'joined':>6s} {'first step s':>12s} {'steps':>6s} "
        f"{'with all':>14s} {'with all, all up':>17s} {'with one or more':>16s} {'rounds ok/failed':>16s} "
        f"{'global steps':>12s}"
    )
    for mode, r in results.items():
        for name, t in r["trainers"].items():
            up = f"{100 * t.get('with_all_while_all_share', 0):3.0f}% of {t.get('steps_while_all', 0)}"
            print(
                f"{mode:8s} {name:8s} {str(t['joined']):>6s} {t['first_step_s'] or '-':>12} {t['steps']:>6d} "
                f"{t['with_all']:>7d} ({100 * t['with_all_share']:3.0f}%) {up:>17s} {t['averaged']:>16d} "
                f"{t['rounds_averaged']:>8d}/{t['rounds_failed']:<7d} {r['global_steps']:>12d}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    netns.print_finished(started)
    summary = {"event": "nat_summary", "homes": args.homes, "strategy": args.strategy, "modes": {}}
    summary["public_trainer"] = args.public_trainer
    for mode, r in results.items():
        homes = [t for name, t in r["trainers"].items() if name.startswith("home")]
        summary["modes"][mode] = {
            "joined": all(t["joined"] for t in homes),
            "with_all_share": min(t["with_all_share"] for t in homes),
            "with_all_while_all_share": min(t.get("with_all_while_all_share", 0.0) for t in homes),
            "first_step_s": max((t["first_step_s"] or 1e9) for t in homes),
            "rounds_failed": sum(t["rounds_failed"] for t in homes),
            "rounds_failed_while_all": sum(t.get("rounds_failed_while_all", 0) for t in homes),
            "global_steps": r["global_steps"],
        }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
