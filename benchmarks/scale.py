"""Scale: a swarm of 16 or more trainers, each on a host of its own, with a monitor and an evaluation peer.

Every role runs in a network namespace of its own (``netns.Network``) with a ``tbf``-shaped link: the
monitor and the evaluation peer at 100 Mbit/s; the trainers mixed, two of every three at 100 Mbit/s and
one at 20 Mbit/s, and every fourth in client mode (it reaches others, none reach it). The monitor and the
evaluation peer are cotrain's own roles (``cotrain monitor``, ``cotrain eval``, preset ``albert-tiny`` on a
dataset made from the built-in corpus). A trainer runs what ``cotrain train`` runs around its model:
cotrain's DHT (``SwarmConnection``, with the config check against the swarm), the ``albert-tiny`` model for
the dataset's tokenizer and ``cotrain.SwarmPeer`` with the preset's optimizer; its forward and backward
passes are SIMULATED: it sleeps ``--step-time`` seconds per ``opt.step`` call, whose gradients are fixed
random numbers (so 16-32 peers fit on 2 cores; the cores' load is reported). The all-reduces, the progress
records, the state downloads and averaging are real.

A configuration runs ``--minutes`` of training after every trainer has joined; for each
``--group-sizes`` entry (the trainers' ``--target-group-size``; 0: the whole swarm, one big group against
Moshpit-style small groups) one configuration without churn, and one with churn (``--churn``): every
``--kill-every`` seconds a random trainer's host vanishes (SIGKILL to every process in its namespace) and a
new trainer starts on a new host. A newcomer is also started once in a configuration without churn, as soon
as the first trainers have joined. A configuration goes on past ``--minutes`` (without churn) until every
newcomer contributes or ``--newcomer-timeout`` seconds have passed since its start. Each configuration
reports:

- global steps, and global steps per minute (the highest step any trainer reached);
- the averaging groups formed (the group size each trainer saw at each global step: a histogram, the
  largest), and rounds averaged and failed (summed over the trainers);
- DHT traffic per trainer: the bytes of the DHT requests a trainer makes and of their answers (protobuf
  payload, counted in its DHT process; libp2p framing not included), per minute;
- newcomer seconds: from the start of a newcomer's process to the end of its first all-reduce that
  averaged its gradients with others (it contributes), per newcomer;
- a trainer's memory (PSS of its process tree: the peer, its DHT and averager processes, p2pd) and what
  that lets this machine hold; the machine's busy cores.

    python benchmarks/scale.py [--peers 16] [--group-sizes 4 8 0] [--minutes 3] [--churn] [--quick]
                               [--json FILE] [--keep-logs]

``--quick``: 16 peers, group size 4, 2 minutes, plus one churn configuration of 2 minutes. The last line is
``{"event": "scale_summary", "peers": ..., "global_steps": ..., "max_group_size": ..., "failed_rounds": ...,
"newcomer_seconds": ...}`` over every configuration run.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import netns  # noqa: E402
from lib.netns import CpuSampler, fixed_gradients, say, simulated_peer  # noqa: E402
from lib.roles import demo_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRESET = "albert-tiny"
RUN_ID = "scale"
MONITOR, EVALUATOR = 0, 1  # hosts; trainers from 2 on
FAST_RATE, SLOW_RATE = 100.0, 20.0


def trainer_rate(k: int) -> float:
    """Trainer k's link: one in three at 20 Mbit/s."""
    return SLOW_RATE if k % 3 == 2 else FAST_RATE


def trainer_client(k: int) -> bool:
    """Trainer k is in client mode: one in four."""
    return k % 4 == 3


# ----------------------------------------------------------------------------------------------- DHT traffic


def dht_key_names(run_id: str) -> dict[bytes, str]:
    """The DHT keys a swarm of ``run_id`` reads and writes, by the id the DHT stores them under."""
    from hivemind.dht.routing import DHTID

    from cotrain import keys

    names = {
        "progress": keys.progress_key(run_id),
        "metrics": keys.metrics_key(run_id),
        "eval": keys.eval_key(run_id),
        "config": keys.config_key(run_id),
        "runs": keys.runs_key(),
        "fingerprints": keys.state_fingerprints_key(run_id),
        "served_state": keys.served_state_key(run_id),
        "revocations": keys.revocations_key(run_id),
        # hivemind's matchmaking: an averager looks for groups under f"{prefix}.0b{group bits}"
        "grad_matchmaking": f"{keys.grad_averager_prefix(run_id)}.0b",
        "state_matchmaking": f"{keys.state_averager_prefix(run_id)}.0b",
    }
    return {DHTID.generate(source=key).to_bytes(): name for name, key in names.items()}


class DhtBytes:
    """Counts the protobuf payload of the DHT requests this peer makes and of their answers, per kind of
    request (ping, store, find) and, for finds, per key read (``dht_key_names``, else "other"), in its DHT
    process (a fork of this one: the counters are shared memory)."""

    KINDS = ("rpc_ping", "rpc_store", "rpc_find")

    def __init__(self, run_id: str = RUN_ID) -> None:
        self.names = dht_key_names(run_id)
        self.counts = {kind: mp.Value("d", 0.0, lock=False) for kind in self.KINDS}
        self.found = {name: mp.Value("d", 0.0, lock=False) for name in [*self.names.values(), "other"]}

    def install(self) -> None:
        from hivemind.dht.protocol import DHTProtocol

        original = DHTProtocol.get_stub
        counts, found, names = self.counts, self.found, self.names

        class Counted:
            def __init__(self, stub) -> None:
                self._stub = stub

            def __getattr__(self, name: str):
                call = getattr(self._stub, name)
                if name not in counts:
                    return call

                async def counted(request, *args, **kwargs):
                    counts[name].value += request.ByteSize()
                    response = await call(request, *args, **kwargs)
                    counts[name].value += response.ByteSize()
                    if name == "rpc_find":
                        for key, result in zip(request.keys, response.results, strict=False):
                            found[names.get(key, "other")].value += len(key) + result.ByteSize()
                    return response

                return counted

        def get_stub(protocol, peer):
            return Counted(original(protocol, peer))

        DHTProtocol.get_stub = get_stub

    def snapshot(self) -> dict[str, float]:
        out = {kind.removeprefix("rpc_"): value.value for kind, value in self.counts.items()}
        return out | {f"find:{name}": value.value for name, value in self.found.items()}


# ----------------------------------------------------------------------------------------------- peer process


def peer_main(args: argparse.Namespace) -> None:
    import torch

    from cotrain.config import resolve
    from cotrain.data import ExampleStream, tokenizer_hash
    from cotrain.engine import SwarmConnection
    from cotrain.models import model_for_tokenizer

    # this process's start (``ip netns exec`` execs it in the process the driver forked)
    launched = time.monotonic() - (time.time() - psutil.Process().create_time())
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cotrain").setLevel(logging.INFO)  # joins, downloads, partial all-reduces
    dht_bytes = DhtBytes()
    dht_bytes.install()  # before the DHT's process is forked
    config = resolve(PRESET, overrides=run_overrides(args) | {"peer": peer_overrides(args)})
    run, peer = config.run, config.peer
    connection = SwarmConnection(run.run_id, peer, role="trainer")
    tokenizer = ExampleStream(args.data, seed=args.index).tokenizer
    connection.agree(run, tokenizer_hash(tokenizer))
    model = model_for_tokenizer(run, tokenizer)
    samples = peer.per_device_train_batch_size * peer.gradient_accumulation_steps
    swarm = simulated_peer(run, peer, model, connection)
    swarm.catch_up()
    swarm.start()
    fixed_gradients(model, args.index)
    say(ready=True, pid=os.getpid(), maddrs=swarm.maddrs)
    if not args.at_once:
        sys.stdin.readline()  # the first trainers start computing together
    quit_ = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if "quit" in line:
                break
        quit_.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    epoch, contributing = swarm.global_step, False
    while not quit_.is_set():
        time.sleep(args.step_time)  # the simulated forward/backward passes
        swarm.step(batch_size=samples, zero_grad=False)
        averaged, failed = swarm.strategy.progress.rounds_averaged, swarm.strategy.progress.rounds_failed
        if averaged and not contributing and swarm.last_group_size > 1:
            contributing = True
            say(contributing=time.monotonic() - launched, group=swarm.last_group_size)
        if swarm.global_step != epoch:
            epoch = swarm.global_step
            say(
                epoch=epoch,
                t=time.monotonic(),
                group=swarm.last_group_size,
                averaged=averaged,
                failed=failed,
                dht_bytes=dht_bytes.snapshot(),
            )
    swarm.shutdown()


def run_overrides(args: argparse.Namespace) -> dict:
    """The swarm-wide settings every role of the benchmark shares."""
    return {"run": {"run_id": RUN_ID, "target_batch_size": args.target_batch_size}}


def peer_overrides(args: argparse.Namespace) -> dict:
    return {
        "matchmaking_time": args.matchmaking_time,
        "averaging_timeout": args.averaging_timeout,
        "host_maddrs": [f"/ip4/{args.address}/tcp/0"],
        "initial_peers": args.initial_peers,
        "client_mode": args.client,
        "target_group_size": args.group_size,
        "per_device_train_batch_size": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "statistics_expiration": 30.0,
    }


# ------------------------------------------------------------------------------------------- orchestration


def role_argv(role: str, args: argparse.Namespace, host: str, initial: list[str], out: Path) -> list[str]:
    """The command line of the monitor or the evaluation peer."""
    common = [
        sys.executable, "-m", "cotrain", role, "--preset", PRESET, "--run-id", RUN_ID,
        "--target-batch-size", str(args.target_batch_size), "--matchmaking-time", str(args.matchmaking_time),
        "--averaging-timeout", str(args.averaging_timeout), "--host-maddrs", f"/ip4/{host}/tcp/0",
        "--torch-threads", "1", "--output-dir", str(out), "--dataset-path", str(args.data),
    ]  # fmt: skip
    if initial:
        common += ["--initial-peers", *initial]
    if role == "monitor":
        return [*common, "--refresh-period", "2", "--dashboard-port", "-1", "--save-every", "600"]
    return [*common, "--eval-every", "30", "--eval-batches", "2"]


def trainer_argv(
    args: argparse.Namespace, k: int, address: str, initial: list[str], group_size: int, at_once: bool
) -> list[str]:
    """The command line of trainer ``k`` (this script with ``--peer``) on the host at ``address``."""
    return [
        sys.executable, str(Path(__file__).resolve()), "--peer", "--index", str(k),
        "--address", address, "--initial-peers", *initial,
        "--group-size", str(group_size or args.peers), "--data", str(args.data),
        "--target-batch-size", str(args.target_batch_size), "--micro-batch", str(args.micro_batch),
        "--step-time", str(args.step_time), "--matchmaking-time", str(args.matchmaking_time),
        "--averaging-timeout", str(args.averaging_timeout),
        *(["--client"] if trainer_client(k) else []), *(["--at-once"] if at_once else []),
    ]  # fmt: skip


class Swarm:
    """One configuration's roles on one network: the monitor, the evaluation peer and the trainers."""

    def __init__(self, args: argparse.Namespace, group_size: int, churn: bool, logdir: Path) -> None:
        self.args, self.group_size, self.churn, self.logdir = args, group_size, churn, logdir
        spare = int(args.minutes * 60 / args.kill_every) + 2 if churn else 1
        self.trainer_hosts = args.peers + spare
        rates = [FAST_RATE, FAST_RATE] + [trainer_rate(k) for k in range(self.trainer_hosts)]
        self.net = netns.Network(len(rates), FAST_RATE, rates=rates)
        self.roles: list = []  # the monitor's and the evaluation peer's processes
        self.procs: dict[int, Any] = {}  # trainer k -> its process
        self.inbox: dict[int, list[dict]] = {}
        self.started: dict[int, float] = {}
        self.killed: list[int] = []
        self.initial: list[str] = []
        self.next_trainer = 0

    def start_role(self, role: str, host: int) -> None:
        out = self.logdir / role
        out.mkdir(parents=True, exist_ok=True)
        argv = role_argv(role, self.args, self.net.address(host), self.initial, out)
        log = open(self.logdir / f"{role}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        self.roles.append(netns.start_in_ns(self.net, host, argv, stdout=log, stderr=log, env=env, cwd=REPO))

    def start_monitor(self) -> None:
        self.start_role("monitor", MONITOR)
        peers_file = self.logdir / "monitor" / "initial_peers.txt"
        deadline = time.monotonic() + 300
        while not peers_file.exists():
            if time.monotonic() > deadline or self.roles[0].poll() is not None:
                raise RuntimeError(f"the monitor did not start; see {self.logdir / 'monitor.log'}")
            time.sleep(0.5)
        self.initial = peers_file.read_text().split()

    def start_trainer(self, at_once: bool) -> int:
        import subprocess

        k = self.next_trainer
        if k >= self.trainer_hosts:
            raise RuntimeError("no host left for a new trainer")
        self.next_trainer += 1
        argv = trainer_argv(self.args, k, self.net.address(2 + k), self.initial, self.group_size, at_once)
        log = open(self.logdir / f"trainer{k}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        self.started[k] = time.monotonic()
        proc = netns.start_in_ns(
            self.net, 2 + k, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
            env=env, cwd=REPO,
        )  # fmt: skip
        self.procs[k], self.inbox[k] = proc, []

        def read() -> None:
            for line in proc.stdout:
                if line.startswith(netns.TAG):
                    msg = json.loads(line[len(netns.TAG) :])
                    msg["at"] = time.monotonic()
                    self.inbox[k].append(msg)

        threading.Thread(target=read, daemon=True).start()
        return k

    def newcomers_waiting(self, t0: float, timeout: float) -> list[int]:
        """The trainers started after ``t0`` that are alive, have not contributed yet and were started less
        than ``timeout`` seconds ago."""
        now = time.monotonic()
        fresh = [k for k in self.alive() if self.started[k] > max(t0, now - timeout)]
        return [k for k in fresh if not any("contributing" in m for m in self.inbox[k])]

    def wait_ready(self, ks: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for k in ks:
            while not any("ready" in m for m in self.inbox[k]):
                if self.procs[k].poll() is not None:
                    tail = (self.logdir / f"trainer{k}.log").read_text()[-2000:]
                    raise RuntimeError(f"trainer {k} exited before joining:\n{tail}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"trainer {k} did not join within {timeout:.0f} s; see {self.logdir}")
                time.sleep(0.2)

    def send(self, k: int, line: str) -> None:
        try:
            self.procs[k].stdin.write(line + "\n")
            self.procs[k].stdin.flush()
        except (OSError, ValueError):
            pass

    def alive(self) -> list[int]:
        return [k for k, p in self.procs.items() if p.poll() is None and k not in self.killed]

    def vanish(self, k: int) -> None:
        """Trainer k's machine is switched off: SIGKILL to every process in its namespace."""
        self.net.remember_pids()
        netns.kill_pids(netns.netns_pids(self.net.host_ns(2 + k)), grace=0.0)
        self.killed.append(k)

    def pss_mb(self, pid: int) -> float:
        total = 0.0
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        return total / 2**20

    def stop(self) -> None:
        self.net.remember_pids()
        for k in list(self.procs):
            self.send(k, "quit")
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                pass
            netns.stop_process(proc, grace=3)
        for proc in reversed(self.roles):
            netns.stop_process(proc, grace=15)


def run_config(args: argparse.Namespace, group_size: int, churn: bool, logdir: Path) -> dict:
    label = f"group {group_size or 'all'}{', churn' if churn else ''}"
    rng = random.Random(args.seed)
    swarm = Swarm(args, group_size, churn, logdir)
    sampler = None
    with swarm.net:
        try:
            swarm.start_monitor()
            swarm.start_role("eval", EVALUATOR)
            first = [swarm.start_trainer(at_once=False) for _ in range(args.peers)]
            swarm.wait_ready(first, args.join_timeout)
            print(f"  {label}: {args.peers} trainers joined", flush=True)
            for k in first:
                swarm.send(k, "go")
            swarm.net.remember_pids()
            sampler = CpuSampler(lambda: [p.pid for p in swarm.procs.values()] + [r.pid for r in swarm.roles])
            sampler.start()
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            next_kill = t0 + args.kill_every if churn else float("inf")
            newcomer_at = t0 if not churn else float("inf")
            memory = []
            while time.monotonic() < end or swarm.newcomers_waiting(t0, args.newcomer_timeout):
                now = time.monotonic()
                if now >= end:  # only waiting for newcomers to contribute: no more churn
                    next_kill = float("inf")
                if now >= newcomer_at:
                    newcomer_at = float("inf")
                    swarm.start_trainer(at_once=True)
                if now >= next_kill:
                    next_kill = now + args.kill_every
                    victim = rng.choice(swarm.alive())
                    swarm.vanish(victim)
                    k = swarm.start_trainer(at_once=True)
                    print(f"  {label}: trainer {victim} vanished, trainer {k} started at {now - t0:.0f} s",
                          flush=True)  # fmt: skip
                if not memory and now - t0 > 30:
                    memory = [swarm.pss_mb(swarm.procs[k].pid) for k in first[:4] if k in swarm.alive()]
                    memory.append(swarm.pss_mb(swarm.roles[0].pid))
                    memory.append(swarm.pss_mb(swarm.roles[1].pid))
                time.sleep(0.5)
            t1 = time.monotonic()
            crashed = [k for k, p in swarm.procs.items() if p.poll() is not None and k not in swarm.killed]
            for k in crashed:  # why, while its log is still there
                tail = (logdir / f"trainer{k}.log").read_text(errors="replace").strip().splitlines()[-4:]
                print(f"  {label}: trainer {k} exited ({swarm.procs[k].poll()}):", *tail, sep="\n    ")
        finally:
            if sampler is not None:
                sampler.stopped.set()
            swarm.stop()
    machine, ours = sampler.cores(t0, t1) if sampler else (float("nan"), float("nan"))
    return summarize(label, group_size, churn, swarm, t0, t1, memory, crashed, machine, ours)


def summarize(label, group_size, churn, swarm: Swarm, t0, t1, memory, crashed, machine, ours) -> dict:
    steps, groups, averaged, failed, dht_rates, dht_kinds = [], Counter(), 0, 0, [], {}
    newcomer = []
    for k, msgs in swarm.inbox.items():
        marks = [m for m in msgs if "epoch" in m and t0 <= m["at"] <= t1]
        seen = set()
        for m in marks:
            steps.append(m["epoch"])
            if m["epoch"] not in seen:
                seen.add(m["epoch"])
                groups[m["group"]] += 1
        if marks:
            averaged += marks[-1]["averaged"]
            failed += marks[-1]["failed"]
            if len(marks) >= 2 and marks[-1]["at"] > marks[0]["at"]:
                span = marks[-1]["at"] - marks[0]["at"]
                a, b = marks[0]["dht_bytes"], marks[-1]["dht_bytes"]
                per_kind = {kind: (b[kind] - a[kind]) / span * 60 for kind in b}
                dht_rates.append(sum(rate for kind, rate in per_kind.items() if ":" not in kind))
                for kind, rate in per_kind.items():
                    dht_kinds[kind] = dht_kinds.get(kind, 0.0) + rate
        if swarm.started[k] > t0:  # a newcomer
            done = [m["contributing"] for m in msgs if "contributing" in m]
            newcomer.append(round(done[0], 1) if done else None)
    first_step = min(steps) if steps else 0
    last_step = max(steps) if steps else 0
    minutes = (t1 - t0) / 60
    pss = memory[:-2] if len(memory) > 2 else []
    return {
        "config": label,
        "group_size": group_size or swarm.args.peers,
        "churn": churn,
        "trainers": swarm.args.peers,
        "minutes": round(minutes, 2),
        "global_steps": last_step - first_step,
        "steps_per_minute": round((last_step - first_step) / minutes, 2),
        "groups": dict(sorted(groups.items())),
        "max_group_size": max(groups) if groups else 0,
        "rounds_averaged": averaged,
        "failed_rounds": failed,
        "dht_kb_per_minute": round(statistics.mean(dht_rates) / 1024, 1) if dht_rates else None,
        "dht_kb_per_minute_max": round(max(dht_rates) / 1024, 1) if dht_rates else None,
        "dht_kb_per_minute_by_kind": {k: round(v / len(dht_rates) / 1024, 1) for k, v in dht_kinds.items()},
        "newcomer_seconds": newcomer,
        "vanished": len(swarm.killed),
        "crashed": crashed,
        "trainer_pss_mb": round(statistics.mean(pss), 1) if pss else None,
        "monitor_pss_mb": round(memory[-2], 1) if len(memory) >= 2 else None,
        "eval_pss_mb": round(memory[-1], 1) if memory else None,
        "cores_busy": round(machine, 2),
        "cores_ours": round(ours, 2),
    }


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print()
    print(
        f"{args.peers} trainers ({PRESET}, simulated compute {args.step_time:g} s per call of "
        f"{args.micro_batch} samples, target batch {args.target_batch_size}; links: 2 of 3 at "
        f"{FAST_RATE:g} Mbit/s, 1 of 3 at {SLOW_RATE:g}, 1 of 4 in client mode), a monitor and an evaluation "
        f"peer; matchmaking {args.matchmaking_time:g} s, averaging timeout {args.averaging_timeout:g} s"
    )
    print()
    print("| configuration | global steps (per minute) | groups (size: count) | rounds averaged / failed "
          "| DHT KiB/min per trainer (mean, max) | newcomer s | crashed | cores busy |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        groups = ", ".join(f"{s}: {c}" for s, c in r["groups"].items())
        newcomers = ", ".join("-" if s is None else f"{s:g}" for s in r["newcomer_seconds"])
        print(
            f"| {r['config']} | {r['global_steps']} ({r['steps_per_minute']:g}) | {groups} "
            f"| {r['rounds_averaged']} / {r['failed_rounds']} "
            f"| {r['dht_kb_per_minute']}, {r['dht_kb_per_minute_max']} | {newcomers} | {len(r['crashed'])} "
            f"| {r['cores_busy']:.2f} |"
        )
    pss = [r["trainer_pss_mb"] for r in rows if r["trainer_pss_mb"]]
    if pss:
        per = statistics.mean(pss)
        total = psutil.virtual_memory().total / 2**20
        print(
            f"\nA trainer: {per:.0f} MiB PSS (its process tree); the monitor "
            f"{rows[0]['monitor_pss_mb']} MiB, the evaluation peer {rows[0]['eval_pss_mb']} MiB. "
            f"This machine's {total / 1024:.0f} GiB hold about {int(total * 0.85 / per)} such trainers "
            f"(85% of memory)."
        )


def summary_line(rows: list[dict], args: argparse.Namespace) -> dict:
    newcomers = [s for r in rows for s in r["newcomer_seconds"]]
    done = [s for s in newcomers if s is not None]
    return {
        "event": "scale_summary",
        "peers": args.peers,
        "global_steps": sum(r["global_steps"] for r in rows),
        "max_group_size": max((r["max_group_size"] for r in rows), default=0),
        "failed_rounds": sum(r["failed_rounds"] for r in rows),
        "newcomer_seconds": round(max(done), 1) if done else None,
        "newcomers_not_contributing": len(newcomers) - len(done),
        "crashed": sum(len(r["crashed"]) for r in rows),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=16, help="trainers (default 16)")
    ap.add_argument(
        "--group-sizes",
        type=int,
        nargs="+",
        default=[4, 8, 0],
        help="the trainers' --target-group-size, one configuration each (0: the whole swarm)",
    )
    ap.add_argument("--minutes", type=float, default=3.0, help="training time per configuration")
    ap.add_argument("--churn", action="store_true", help="also run each configuration with churn")
    ap.add_argument("--kill-every", type=float, default=30.0, help="churn: s between vanishing trainers")
    ap.add_argument("--step-time", type=float, default=1.0, help="simulated s per opt.step call")
    ap.add_argument("--micro-batch", type=int, default=32, help="samples per opt.step call")
    ap.add_argument("--target-batch-size", type=int, default=0, help="default: peers x micro-batch x 5")
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--averaging-timeout", type=float, default=30.0)
    ap.add_argument("--join-timeout", type=float, default=600.0, help="s for every first trainer to join")
    ap.add_argument(
        "--newcomer-timeout", type=float, default=150.0,
        help="a configuration goes on until its newcomers contribute, at most this many s after their start",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="which trainers vanish")
    ap.add_argument("--quick", action="store_true", help="group size 4, 2 minutes, plus 2 minutes of churn")
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--keep-logs", action="store_true", help="keep the roles' logs")
    ap.add_argument("--limit", type=float, default=7200.0, help="stop everything after this many seconds")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--group-size", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--at-once", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.peers < 2:
        ap.error("--peers must be at least 2")
    if any(g < 0 or g == 1 for g in args.group_sizes):
        ap.error("--group-sizes: 0 (the whole swarm) or at least 2")
    if args.quick:
        args.group_sizes, args.minutes, args.churn = [4], 2.0, True
    if not args.target_batch_size:
        args.target_batch_size = args.peers * args.micro_batch * 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer:
        peer_main(args)
        return 0
    netns.prepare_namespaces("scale.py", args.limit)
    started = netns.print_started()
    rows = []
    with netns.logs_folder("cotrain-scale-", args.keep_logs) as tmp:
        args.data = str(demo_dataset(tmp))
        configs = [(g, False) for g in args.group_sizes]
        if args.churn:
            configs += [(g, True) for g in args.group_sizes]
        for group_size, churn in configs:
            logdir = tmp / f"g{group_size}{'-churn' if churn else ''}"
            rows.append(run_config(args, group_size, churn, logdir))
            print(f"  {json.dumps(rows[-1])}", flush=True)
    print_table(rows, args)
    summary = summary_line(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    netns.print_finished(started)
    print(json.dumps(summary), flush=True)
    return 0 if not summary["crashed"] else 1


if __name__ == "__main__":
    sys.exit(main())
