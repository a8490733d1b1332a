"""Simulated trainers on namespaced hosts, for ``utilization.py``, ``traffic.py`` and ``aux_load.py``.

A peer process (this module run as a script; ``worker_argv`` builds its command line) runs what ``cotrain
train`` runs around its model: cotrain's DHT (the engine's ``SwarmConnection``) and ``cotrain.SwarmPeer`` with
cotrain's settings for the real ALBERT-large model of the ``albert-large-v2`` preset (or, with
``--model-params``, a simulated model of that size with SGD inner steps), in one of ``MODES``. Its forward and
backward passes are simulated: it sleeps ``--step-time`` s per micro-batch, then calls ``opt.step``. It times
the work a GPU peer does on its GPU inside ``opt.step`` and reports at each global step its compute, its time
in ``opt.step``, its rounds and its bytes. With ``--aux`` it trains nothing and reduces the clients' parts, as
the monitor does.

``run_swarm`` starts a peer per host of a ``lib.netns.Network``, all joined to the first, starts them together
and collects their messages (``collect_marks``) until every peer has reached a global step.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # the peer process, run as a script: its package lies beside the benchmarks
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib.netns import Network, Peers, fixed_gradients, plain_model, say, simulated_peer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ALBERT_LARGE_PARAMS = 17_847_474
V100_STEP_TIME = 4 / 26.64  # s per micro-batch of 4 x 512 tokens (see utilization.py's docstring)
SYNC_DEFAULTS = {"delay_grad_averaging": False, "delay_optimizer_step": False, "delay_state_averaging": True}
MODES = {  # mode: (run settings, peer settings)
    "sync": ({}, SYNC_DEFAULTS),
    "delayed": ({}, dict.fromkeys(SYNC_DEFAULTS, True)),
    "diloco": ({"strategy": "diloco", "outer_overlap": False}, SYNC_DEFAULTS),
    "diloco-overlap": ({"strategy": "diloco", "outer_overlap": True}, SYNC_DEFAULTS),
    "diloco-topk": (
        {"strategy": "diloco", "outer_overlap": False, "outer_compression": "topk"},
        SYNC_DEFAULTS,
    ),
    "diloco-topk-overlap": (
        {"strategy": "diloco", "outer_overlap": True, "outer_compression": "topk"},
        SYNC_DEFAULTS,
    ),
}


def is_diloco(mode: str) -> bool:
    return MODES[mode][0].get("strategy") == "diloco"


def timed(fn, total: list[float]):
    """``fn`` that adds the seconds each call takes to ``total[0]``."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0

    return wrapper


def peer_main(args: argparse.Namespace) -> None:
    import torch

    import cotrain.engine.peer as engine_peer
    from cotrain.config import resolve
    from cotrain.engine import SwarmConnection
    from cotrain.models import build_model

    torch.set_num_threads(1)
    if args.keep_logs:  # cotrain's info lines (rounds, partial all-reduces) in the peer's log
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("cotrain").setLevel(logging.INFO)
    run_settings, peer_settings = MODES[args.mode]
    if is_diloco(args.mode):
        run_settings = {**run_settings, "local_steps": args.local_steps}
    config = resolve(
        "albert-large-v2",
        overrides={
            "run": {
                "run_id": f"util-{args.mode}",
                "target_batch_size": args.target_batch_size,
                **run_settings,
            },
            "peer": {
                "matchmaking_time": args.matchmaking_time,
                "averaging_timeout": args.averaging_timeout,
                "host_maddrs": [f"/ip4/{args.address}/tcp/0"],
                "initial_peers": [args.initial_peer] if args.initial_peer else [],
                "per_device_train_batch_size": args.micro_batch,
                "gradient_accumulation_steps": args.accumulation,
                "client_mode": args.client_mode,
                **peer_settings,
            },
        },
    )
    run, peer = config.run, config.peer
    connection = SwarmConnection(run.run_id, peer, role="monitor" if args.aux else "trainer")
    say(maddrs=connection.maddrs())
    if (
        args.model_params
    ):  # a simulated model of that size, with a plain SGD inner step (utilization.py's docstring)
        model = plain_model(args.model_params)
        inner = lambda params: torch.optim.SGD(params, lr=1e-3)  # noqa: E731
    else:
        model, inner = build_model(run, vocab_size=30000), None
    if args.aux:
        return reducer_main(args, connection, run, peer, model)
    samples = peer.per_device_train_batch_size * peer.gradient_accumulation_steps
    swarm = simulated_peer(run, peer, model, connection, optimizer=inner)
    fixed_gradients(model, args.index)
    on_device = [
        0.0
    ]  # seconds inside opt.step on work a GPU peer does on its GPU (see utilization.py's docstring)
    opt = swarm.strategy.opt
    # the gradients' norm and clipping at every call: a GPU peer computes them on its GPU
    engine_peer.gradient_norm = timed(engine_peer.gradient_norm, on_device)
    round_end = [0.0]  # seconds inside opt.step in DiLoCo's round ends (on the training thread)
    if swarm.strategy.name == "diloco":
        opt.inner_optimizer.step = timed(opt.inner_optimizer.step, on_device)
        opt.outer_round = timed(opt.outer_round, round_end)
    else:
        opt.grad_averager.accumulate_grads_ = timed(opt.grad_averager.accumulate_grads_, on_device)
    say(ready=True)
    sys.stdin.readline()  # all peers start computing together
    quit_ = threading.Event()  # the benchmark's "quit": leave the loop and shut down in order

    def watch_stdin() -> None:
        for line in sys.stdin:
            if "quit" in line:
                break
        quit_.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    compute = in_step = 0.0
    trained = 0  # samples given to opt.step
    epoch = swarm.global_step
    deadline = time.monotonic() + args.peer_limit
    while epoch < args.stop_at and time.monotonic() < deadline and not quit_.is_set():
        t0 = time.perf_counter()
        time.sleep(args.step_time * peer.gradient_accumulation_steps)  # the simulated forward/backward
        t1 = time.perf_counter()
        swarm.step(batch_size=samples, zero_grad=False)
        t2 = time.perf_counter()
        compute, in_step, trained = compute + (t1 - t0), in_step + (t2 - t1), trained + samples
        if trained == samples:  # a peer is seen once it reports samples: wait to see all before going on
            wait_until = time.monotonic() + 120  # (else with a small target the first takes steps alone)
            while (
                swarm.num_peers < args.expect_peers and time.monotonic() < wait_until and not quit_.is_set()
            ):
                time.sleep(0.2)
        if swarm.global_step != epoch:
            epoch = swarm.global_step
            say(
                epoch=epoch,
                t=time.monotonic(),
                compute=compute,
                in_step=in_step,
                on_device=on_device[0],
                round_end=round_end[0],
                rounds=[swarm.strategy.progress.rounds_averaged, swarm.strategy.progress.rounds_failed],
                samples=trained,
                bytes_sent=getattr(opt, "bytes_sent", 0),  # diloco: the engine's count of its payload
                round_bytes=swarm.strategy.progress.round_bytes,
            )
    say(done=epoch)
    swarm.shutdown()


def reducer_main(args: argparse.Namespace, connection, run, peer, model) -> None:
    """A public peer that trains nothing and reduces the others' parts as an auxiliary peer, as the monitor
    does (the strategy's own reducer); at "quit" it says how many rounds it reduced and failed."""
    from cotrain.registry import strategy_class

    reducer = strategy_class(run.strategy).reducer(connection.dht, run, peer, model)
    reducer.start()
    say(ready=True)
    for line in sys.stdin:
        if "quit" in line:
            break
    say(reduced=list(reducer.rounds))
    reducer.close()
    connection.close()


def worker_argv(mode: str, args, stop_at: int, target_batch_size: int) -> list[str]:
    """The command line of a peer process (this module run as a script). ``args`` holds a benchmark's
    settings: ``local_steps``, ``averaging_timeout``, ``matchmaking_time``, ``micro_batch``, ``accumulation``,
    ``step_time``, ``limit``, ``peers``, ``model_params`` and ``keep_logs``; ``Peers.start`` adds each peer's
    ``--index``, ``--address`` and the rest."""
    return [
        sys.executable, str(Path(__file__).resolve()), "--mode", mode,
        "--target-batch-size", str(target_batch_size), "--local-steps", str(args.local_steps),
        "--averaging-timeout", str(args.averaging_timeout),
        "--matchmaking-time", str(args.matchmaking_time),
        "--micro-batch", str(args.micro_batch), "--accumulation", str(args.accumulation),
        "--step-time", str(args.step_time), "--stop-at", str(stop_at), "--peer-limit", str(args.limit),
        "--expect-peers", str(args.peers), "--model-params", str(args.model_params),
        *(["--keep-logs"] if args.keep_logs else []),
    ]  # fmt: skip


def run_swarm(
    net: Network,
    worker: list[str],
    logdir: Path,
    label: str,
    on_go: Callable[[Peers], None],
    until: int,
) -> list[dict[int, dict]]:
    """Start a peer per host of ``net``, all joined to the first, start them together (``on_go`` is called
    then), and collect each peer's messages at its global steps until every peer has reached step ``until``
    (the peers run one step further: one that stopped at ``until`` would leave the others to finish their
    step without it): marks[i][step] = peer i's message when it reached ``step``."""
    n = net.hosts
    peers = Peers(net, worker, logdir, cwd=REPO)
    peers.logdir.mkdir(parents=True, exist_ok=True)
    try:
        peers.start(0, [])
        first = peers.receive(0, 300)["maddrs"][0]
        for i in range(1, n):
            peers.start(i, ["--initial-peer", first])
        for i in range(1, n):
            peers.receive(i, 300)
        for i in range(n):
            peers.receive(i, 300)  # ready
        peers.send({"op": "go"})
        on_go(peers)
        net.remember_pids()  # every peer's processes run now
        found = collect_marks(peers, list(range(n)), until, label)
        marks = [found[i] for i in range(n)]
    finally:
        net.remember_pids()
        peers.stop()
    return marks


def collect_marks(peers: Peers, which: list[int], until: int, label: str) -> dict[int, dict[int, dict]]:
    """Peer i's messages at its global steps, for each i in ``which``, until each has reached step ``until``
    (or said it is done): marks[i][step]."""
    marks: dict[int, dict[int, dict]] = {i: {} for i in which}
    started, done = time.monotonic(), set()
    while len(done) < len(which):
        for i in which:
            if i in done:
                continue
            if until in marks[i]:
                done.add(i)
                continue
            try:
                msg = peers.receive(i, 0.2)
            except RuntimeError as e:
                if "did not answer" not in str(e):
                    raise
                code = peers.procs[i].poll()  # its stdout may stay open in an orphaned child
                if code is not None:
                    cause = " (SIGKILL: out of memory?)" if code == -9 else ""
                    raise RuntimeError(f"peer {i} exited with code {code}{cause}; see {peers.logdir}") from e
                continue
            if "epoch" in msg:
                marks[i][msg["epoch"]] = msg
                print(f"  {label}: peer {i} reached step {msg['epoch']} "
                      f"at {msg['t'] - started:.0f} s", flush=True)  # fmt: skip
            elif "done" in msg:
                done.add(i)
    return marks


def build_parser() -> argparse.ArgumentParser:
    """The peer process's command line (``worker_argv`` builds it; ``Peers.start`` adds ``--index``,
    ``--address``, and ``--initial-peer`` and a role where given)."""
    ap = argparse.ArgumentParser(description="a simulated peer of utilization.py, traffic.py and aux_load.py")
    ap.add_argument("--mode", default="sync", choices=list(MODES))
    ap.add_argument("--target-batch-size", type=int, default=4096)
    ap.add_argument("--local-steps", type=int, default=50, help="diloco: inner steps per round (H)")
    ap.add_argument("--averaging-timeout", type=float, default=60.0)
    ap.add_argument("--matchmaking-time", type=float, default=5.0)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=8, help="micro-batches per opt.step call")
    ap.add_argument("--step-time", type=float, default=V100_STEP_TIME, help="simulated s per micro-batch")
    ap.add_argument("--stop-at", type=int, default=4, help="the global step to stop at")
    ap.add_argument("--peer-limit", type=float, default=1500.0, help="stop after this many seconds")
    ap.add_argument("--expect-peers", type=int, default=1, help="peers to see before a second opt.step")
    ap.add_argument("--model-params", type=int, default=0, help="a simulated model of N parameters")
    ap.add_argument("--keep-logs", action="store_true", help="cotrain's info lines in the peer's log")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--address", default="")
    ap.add_argument("--initial-peer", default="")
    ap.add_argument("--client-mode", action="store_true")
    ap.add_argument("--aux", action="store_true", help="train nothing: reduce the clients' parts")
    return ap


def main(argv: list[str] | None = None) -> None:
    peer_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
