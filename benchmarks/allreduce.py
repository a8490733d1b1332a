"""All-reduce of ALBERT-large's gradients over shaped links: cotrain's averager, the bound, hivemind's.

n peers (2, 4 and 8 by default), each in a network namespace of its own behind a bridge (``netns.Network``);
every link is shaped with ``tbf`` to ``--rate`` Mbit/s each way (``--rate-8`` for 8 peers, so that the link
and not the machine's 2 cores stays the bottleneck). Each peer is a process running a DHT (cotrain's
``create_dht``) and, per precision, two averagers of a vector shaped like ALBERT-large's parameters
(17.8M values in its 32 tensors):

- cotrain: ``cotrain.hivemind_ext.averaging.gradient_averager_factory`` called with the arguments
hivemind.Optimizer
  gives its gradient averager (fp16: ``Float16Compression``, fp32: none), fed through
  ``accumulate_grads_`` and ``step`` as the optimizer does;
- hivemind: a bare ``hivemind.DecentralizedAverager`` with its defaults and the same compression.

cotrain's averager sends its parts over direct TCP connections between the peers (cotrain.hivemind_ext.direct,
its default); ``--libp2p-arm`` adds the same averager with ``direct=False`` (arm ``cotrain-libp2p``: every
part over libp2p, as hivemind sends them), so that the two transports are timed in the same rounds.

``--aggregation centered-clip`` gives cotrain's averager CenteredClip reducers (cotrain.hivemind_ext.reducers)
instead of the mean; ``--aggregation both`` runs the two side by side (arms ``cotrain`` and ``cotrain-clip``)
and reports the time of centered-clip over the mean's.

Rounds of the two arms alternate. All peers are asked to average at the same moment (``scheduled_time``); the
groups must hold all n peers. The time reported is the all-reduce itself: from the moment the first peer of
the group starts aggregating (its group is formed: ``_aggregate_with_group`` begins) to the moment the last
peer has the averaged tensors in place; matchmaking before it (``min_matchmaking_time``, a setting) is not
included. The ratio divides it by the bound 2(n-1)/n x M / bandwidth, M the bytes of the message (2 or 4 per
value). Each result is checked against the true average. Beside each row: the share of the machine's 2 cores
busy during the all-reduces and the TCP goodput of one flow over the same shaped link (the floor any protocol
over TCP starts from). After each precision's rounds, the same bytes are exchanged all-to-all (every peer
sends 2 x M / n to every other peer, all at once) over plain TCP (``netns.tcp_exchange_s``) and over raw
libp2p streams through the peers' daemons (``P2PExchange``): what the links and hivemind's transport allow
for this traffic without the all-reduce's logic. ``--transport quic`` runs the peers' libp2p over QUIC.

    python benchmarks/allreduce.py [--peers 2 4 8] [--rounds 3] [--quick]
    python benchmarks/allreduce.py --peers 4 --dtypes fp16 --aggregation both --exchanges 0
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import netns  # noqa: E402
from lib.netns import CpuSampler, Peers, say  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOAL = 1.15  # the all-reduce over the bandwidth bound, at every n
CLIP_GOAL = 1.1  # centered-clip's all-reduce time over the mean's
AGGREGATION_ARMS = {
    "mean": ("cotrain", "hivemind"),
    "centered-clip": ("cotrain-clip", "hivemind"),
    "both": ("cotrain", "cotrain-clip", "hivemind"),
}


def arms_of(args: argparse.Namespace) -> tuple[str, ...]:
    arms = AGGREGATION_ARMS[args.aggregation]
    return ("cotrain-libp2p", *arms) if args.libp2p_arm else arms


# ----------------------------------------------------------------------------------------------- peer process


def albert_large_shapes() -> list[list[int]]:
    from cotrain.config import resolve
    from cotrain.models import build_model

    model = build_model(resolve("albert-large-v2").run, vocab_size=30000)
    return [list(p.shape) for p in model.parameters()]


def timed(cls):
    """Subclass recording when this peer's all-reduce starts (group formed) and ends (tensors averaged in
    place), in shared memory written by the averager process. Instrumentation only."""
    import torch

    class Timed(cls):
        def __init__(self, *args, **kwargs):
            self.window = torch.zeros(2, dtype=torch.float64).share_memory_()
            super().__init__(*args, **kwargs)

        async def _aggregate_with_group(self, *args, **kwargs):
            self.window[0], self.window[1] = time.monotonic(), 0.0
            try:
                return await super()._aggregate_with_group(*args, **kwargs)
            finally:
                self.window[1] = time.monotonic()

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


def peer_main(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.compression import Float16Compression, NoCompression

    from cotrain.net.dht import create_dht, visible_maddrs

    torch.set_num_threads(1)
    shapes = json.loads(Path(args.shapes).read_text())
    dht = create_dht(
        host_maddrs=[
            f"/ip4/{args.address}/udp/0/quic-v1" if args.transport == "quic" else f"/ip4/{args.address}/tcp/0"
        ],
        initial_peers=[args.initial_peer] if args.initial_peer else [],
    )
    say(maddrs=visible_maddrs(dht))
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(shape, generator=gen) * 1e-3 for shape in shapes]  # gradient-like magnitudes
    mine = args.index + 1
    expected = (args.group_size + 1) / 2  # mean of 1..n
    averagers: dict = {}
    params: list = []

    def check(tensors) -> float:
        err = 0.0
        for t, b in zip(tensors, base, strict=True):
            err = max(err, ((t - b * expected).abs().max() / (b.abs().max() * expected)).item())
        return err

    exchange = P2PExchange(dht)
    say(peer_id=str(dht.peer_id))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "p2p":
            say(**exchange.run(cmd["peers"], cmd["bytes"], cmd["at"]))
        elif cmd["op"] == "phase":
            for avg in averagers.values():
                avg.shutdown()
            averagers.clear()
            compression = Float16Compression() if cmd["dtype"] == "fp16" else NoCompression()
            group = dict(target_group_size=args.group_size, min_group_size=args.group_size)
            params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
            for p, b in zip(params, base, strict=True):
                p.grad = b * mine
            for arm in arms_of(args):
                if arm.startswith("cotrain"):
                    aggregation = "centered-clip" if arm == "cotrain-clip" else "mean"
                    averagers[arm] = make_cotrain_averager(
                        args,
                        dht,
                        cmd["dtype"],
                        params,
                        compression,
                        group,
                        aggregation,
                        arm != "cotrain-libp2p",
                    )
            averagers["hivemind"] = timed(hivemind.DecentralizedAverager)(
                averaged_tensors=[torch.zeros(shape) for shape in shapes],
                dht=dht,
                prefix=f"bench{cmd['dtype']}_bare",
                min_matchmaking_time=args.matchmaking_time,
                compression=compression,
                start=True,
                **group,
            )
            say(ready=cmd["dtype"])
        elif cmd["op"] == "round":
            avg = averagers[cmd["arm"]]
            timeout = cmd["at"] - time.time() + args.round_timeout
            try:
                if cmd["arm"].startswith("cotrain"):
                    avg.accumulate_grads_(batch_size=1)
                    gathered = avg.step(scheduled_time=cmd["at"], timeout=timeout)
                    avg.notify_used_averaged_gradients()
                else:
                    with avg.get_tensors() as tensors:
                        for t, b in zip(tensors, base, strict=True):
                            t.copy_(b * mine)
                    gathered = avg.step(scheduled_time=cmd["at"], timeout=timeout)
                with avg.get_tensors() as tensors:
                    err = check(tensors)
                group_size = len(gathered) if gathered else 0
                say(
                    round=cmd["round"],
                    arm=cmd["arm"],
                    group=group_size,
                    err=err,
                    t0=avg.window[0].item(),
                    t1=avg.window[1].item(),
                )
            except Exception as e:  # a failed round is reported, not fatal
                say(round=cmd["round"], arm=cmd["arm"], group=0, error=repr(e)[:300], t0=0.0, t1=0.0)
        elif cmd["op"] == "quit":
            break
    for avg in averagers.values():
        avg.shutdown()
    exchange.close()
    dht.shutdown()


class P2PExchange:
    """Every peer sends the same bytes to every other peer over raw libp2p streams, all at once, through the
    DHT's p2pd daemon as the averagers reach it (``dht.replicate_p2p``): the all-reduce's traffic over its
    transport (Noise-encrypted TCP, yamux streams, the daemon's Unix sockets) with nothing between the flows.
    Its time over the bound is what the transport allows; the all-reduce's excess over it is its own."""

    HANDLER = "bench_exchange"

    def __init__(self, dht) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.ends: list[tuple[float, int]] = []
        self.p2p = self._call(self._start(dht))

    def _call(self, coro, timeout: float = 600.0):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, dht):
        p2p = await dht.replicate_p2p()
        await p2p.add_binary_stream_handler(self.HANDLER, self._receive)
        return p2p

    async def _receive(self, _info, reader, writer) -> None:
        got = 0
        while chunk := await reader.read(1 << 20):
            got += len(chunk)
        self.ends.append((time.time(), got))
        writer.close()

    async def _exchange(self, peers: list[str], size: int, at: float) -> dict:
        import asyncio

        from hivemind.p2p import PeerID

        others = [PeerID.from_base58(p) for p in peers if p != str(self.p2p.peer_id)]
        streams = [await self.p2p.call_binary_stream_handler(peer, self.HANDLER) for peer in others]
        await asyncio.sleep(max(0.0, at - time.time()))

        async def send(reader, writer) -> None:
            block, left = memoryview(bytes(1 << 20)), size
            while left > 0:
                writer.write(block[: min(left, len(block))])
                left -= min(left, len(block))
                await writer.drain()
            writer.write_eof()  # half-close: closing the socket to p2pd at once could cut the stream's tail
            await reader.read()  # the receiver closes its side once it has read everything
            writer.close()

        await asyncio.gather(*(send(r, w) for _, r, w in streams))
        while len(self.ends) < len(others):
            await asyncio.sleep(0.01)
        return {"end": max(t for t, _ in self.ends), "got": sum(g for _, g in self.ends)}

    def run(self, peers: list[str], size: int, at: float) -> dict:
        self.ends = []
        try:
            return self._call(self._exchange(peers, size, at))
        except Exception as e:  # reported, not fatal
            return {"error": repr(e)[:300]}

    def close(self) -> None:
        try:
            self._call(self.p2p.shutdown(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


def make_cotrain_averager(args, dht, dtype, params, compression, group, aggregation="mean", direct=True):
    """cotrain's gradient averager, built with the arguments hivemind.Optimizer._make_gradient_averager passes
    (run_id "bench<dtype>", "bench<dtype>_clip" with centered-clip, "bench<dtype>_libp2p" without the direct
    path)."""
    from cotrain.algorithms.aggregation import build
    from cotrain.hivemind_ext.averaging import gradient_averager_factory

    opts: dict = {"bandwidth": args.bandwidth} if args.bandwidth > 0 else {}
    opts["aggregation"], opts["direct"] = build(aggregation), direct
    if args.part_size > 0:
        opts["part_size_bytes"] = int(args.part_size * 1024)
    if args.read_ahead > 0:
        opts["read_ahead"] = args.read_ahead
    factory = gradient_averager_factory(opts)
    cls = timed(factory.func)
    return cls(
        dht=dht,
        prefix=f"bench{dtype}{'_clip' if aggregation != 'mean' else ''}{'' if direct else '_libp2p'}"
        "_grad_averager",
        parameters=params,
        min_matchmaking_time=args.matchmaking_time,
        allreduce_timeout=None,
        shutdown_timeout=5,
        next_chunk_timeout=None,
        client_mode=False,
        auxiliary=False,
        start=True,
        reuse_grad_buffers=False,
        compression=compression,
        **{**factory.keywords, **group},
    )


# ------------------------------------------------------------------------------------------- orchestration


def peer_argv(n: int, args, shapes_file: Path) -> list[str]:
    """The command line of a peer process (this script with ``--peer``) in a group of ``n``; ``Peers.start``
    adds its ``--index``, ``--address`` and ``--initial-peer``."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--peer",
        "--shapes",
        str(shapes_file),
        "--group-size",
        str(n),
        "--matchmaking-time",
        str(args.matchmaking_time),
        "--bandwidth",
        str(args.bandwidth),
        "--part-size",
        str(args.part_size),
        "--read-ahead",
        str(args.read_ahead),
        "--transport",
        args.transport,
        "--aggregation",
        args.aggregation,
        *(["--libp2p-arm"] if args.libp2p_arm else []),
    ]


def run_group(n: int, rate: float, args, shapes_file: Path, logdir: Path) -> list[dict]:
    rows = []
    with netns.Network(n, rate, congestion=args.congestion_control) as net:
        print(
            f"n={n}: {rate:g} Mbit/s links, libp2p over {args.transport}, "
            f"TCP congestion control {net.congestion_control()}",
            flush=True,
        )
        goodput = netns.tcp_goodput_mbit(net, 0, 1, megabytes=max(8, int(rate / 8 * 3)))
        worker = peer_argv(n, args, shapes_file)
        peers = Peers(net, worker, logdir / f"n{n}", cwd=REPO)
        peers.logdir.mkdir(parents=True, exist_ok=True)
        sampler = CpuSampler(peers.pids)
        links = netns.LinkCounters(net)
        try:
            peers.start(0, [])
            first = peers.receive(0, 300)["maddrs"][0]
            for i in range(1, n):
                peers.start(i, ["--initial-peer", first])
            for i in range(1, n):
                peers.receive(i, 300)
            peer_ids = [peers.receive(i, 300)["peer_id"] for i in range(n)]
            sampler.start()
            for dtype in args.dtypes:
                numel = sum(_numel(s) for s in json.loads(shapes_file.read_text()))
                message = numel * (2 if dtype == "fp16" else 4)
                payload = 2 * (n - 1) / n * message  # what each peer must send, and receive
                peers.send({"op": "phase", "dtype": dtype})
                for i in range(n):
                    peers.receive(i, 300)
                arms = arms_of(args)
                results: dict[str, list] = {arm: [] for arm in arms}
                warmup = args.warmup if dtype == args.dtypes[0] else 0  # the processes are warm by then
                for r in range(-warmup, args.rounds):
                    for arm in arms if r % 2 == 0 else arms[::-1]:
                        at = time.time() + args.matchmaking_time + 1.0
                        peers.send({"op": "round", "round": r, "arm": arm, "at": at})
                        answers = [
                            peers.receive(i, args.matchmaking_time + args.round_timeout + 60)
                            for i in range(n)
                        ]
                        res = round_summary(answers, n, sampler, links, rate * 1e6 / 8, payload)
                        if args.trace and res["ok"]:
                            with open(args.trace, "a") as f:
                                w0, w1 = res["window"]
                                trace = [s for s in links.samples if w0 - 1 <= s[0] <= w1 + 1]
                                f.write(
                                    json.dumps(
                                        {
                                            "n": n,
                                            "dtype": dtype,
                                            "arm": arm,
                                            "round": r,
                                            "answers": answers,
                                            "links": trace,
                                        }
                                    )
                                    + "\n"
                                )
                        if r >= 0:
                            results[arm].append(res)
                        print(
                            f"  n={n} {dtype} {arm:8s} "
                            + (f"round {r}: " if r >= 0 else "warm-up: ")
                            + (
                                f"{res['seconds']:.2f} s, group {res['group']}, cores {res['machine']:.2f}, "
                                f"uplinks busy {res['busy']:.0%}, sent / payload {res['overhead']:.3f}, "
                                f"error {res['err']:.0e}"
                                if res["ok"]
                                else f"failed ({res['why']})"
                            ),
                            flush=True,
                        )
                bound = netns.allreduce_bound_s(n, message, rate * 1e6)
                per_flow = int(payload / (n - 1))
                tcp = [netns.tcp_exchange_s(net, per_flow) for _ in range(args.exchanges)]
                exchanges = [p2p_exchange_s(peers, peer_ids, per_flow) for _ in range(args.exchanges)]
                libp2p = [t for t, _ in exchanges]
                print(
                    f"  n={n} {dtype} all-to-all of the same bytes: plain TCP "
                    + ", ".join(f"{t:.2f}" for t in tcp)
                    + " s; libp2p "
                    + ", ".join(f"{t:.2f}" + (f" ({d:.2%} delivered)" if d < 1 else "") for t, d in exchanges)
                    + " s",
                    flush=True,
                )
                rows.append(row(n, rate, dtype, message, bound, goodput, results, tcp, libp2p))
        finally:
            sampler.stopped.set()
            links.close()
            peers.stop()
    return rows


def p2p_exchange_s(peers: Peers, peer_ids: list[str], per_flow: int) -> tuple[float, float]:
    """Seconds for the peers' libp2p all-to-all (``P2PExchange``) from the common start to the last byte, and
    the share of the bytes delivered (a stream can end before its last bytes arrive: reported, not fatal)."""
    at = time.time() + 2.0
    peers.send({"op": "p2p", "peers": peer_ids, "bytes": per_flow, "at": at})
    answers = [peers.receive(i, 600) for i in range(len(peer_ids))]
    for a in answers:
        if "error" in a:
            raise RuntimeError(f"libp2p exchange failed: {a['error']}")
    delivered = sum(a["got"] for a in answers) / (per_flow * len(peer_ids) * (len(peer_ids) - 1))
    return max(a["end"] for a in answers) - at, delivered


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def round_summary(answers, n, sampler: CpuSampler, links: netns.LinkCounters, rate_bytes, payload) -> dict:
    bad = [a for a in answers if a.get("error") or a["group"] != n or not a["t1"]]
    if bad:
        why = bad[0].get("error") or f"group of {bad[0]['group']}"
        return {"ok": False, "why": why}
    t0, t1 = min(a["t0"] for a in answers), max(a["t1"] for a in answers)
    machine, ours = sampler.cores(t0, t1)
    time.sleep(0.2)  # let the link counters pass t1
    moved = links.between(t0, t1)
    sent = [up for up, _ in moved] or [float("nan")]
    return {
        "busy": statistics.mean(sent) / ((t1 - t0) * rate_bytes),
        "overhead": statistics.mean(sent) / payload,
        "ok": True,
        "window": (t0, t1),
        "seconds": t1 - t0,
        "group": n,
        "err": max(a["err"] for a in answers),
        "machine": machine,
        "ours": ours,
        "per_peer": [a["t1"] - a["t0"] for a in answers],
    }


def row(n, rate, dtype, message, bound, goodput, results, tcp=(), libp2p=()) -> dict:
    out = {
        "n": n,
        "rate": rate,
        "dtype": dtype,
        "message_mb": message / 1e6,
        "bound": bound,
        "tcp_floor": rate / goodput,
        "tcp_exchange": statistics.median(tcp) / bound if tcp else float("nan"),
        "libp2p_exchange": statistics.median(libp2p) / bound if libp2p else float("nan"),
    }
    for arm in results:
        ok = [r for r in results[arm] if r["ok"]]
        out[arm] = {
            "rounds": len(ok),
            "failed": len(results[arm]) - len(ok),
            "seconds": statistics.median(r["seconds"] for r in ok) if ok else float("nan"),
            "all": [round(r["seconds"], 3) for r in ok],
            "machine": statistics.median(r["machine"] for r in ok) if ok else float("nan"),
            "ours": statistics.median(r["ours"] for r in ok) if ok else float("nan"),
            "busy": statistics.median(r["busy"] for r in ok) if ok else float("nan"),
            "err": max((r["err"] for r in ok), default=float("nan")),
        }
        out[arm]["ratio"] = out[arm]["seconds"] / bound
    return out


def print_table(rows: list[dict]) -> None:
    """The table of all-reduce times; with a centered-clip arm, its time beside the mean's."""
    arms = [
        arm
        for arm in ("cotrain", "cotrain-libp2p", "cotrain-clip", "hivemind")
        if all(arm in r for r in rows)
    ]
    main = "cotrain" if "cotrain" in arms else "cotrain-clip"
    clip = "cotrain-clip" in arms and "cotrain" in arms
    over = all("cotrain-libp2p" in r for r in rows)
    print()
    print(
        f"| n | link | dtype | message | bound | {main} | ratio "
        + ("| cotrain over libp2p | ratio " if over else "")
        + ("| cotrain centered-clip | ratio | centered-clip / mean " if clip else "")
        + "| hivemind | ratio | cotrain / hivemind "
        "| TCP floor | all-to-all: TCP / libp2p | uplinks busy (cotrain / hivemind) "
        "| cores busy (machine / peers) |"
    )
    print(
        "|---|---|---|---|---|---|---|"
        + ("---|---|" if over else "")
        + ("---|---|---|" if clip else "")
        + "---|---|---|---|---|---|---|"
    )
    for r in rows:
        c, h = r[main], r["hivemind"]
        clip_cells = ""
        if over:
            p = r["cotrain-libp2p"]
            clip_cells += f"| {p['seconds']:.2f} s | {p['ratio']:.3f} "
        if clip:
            k = r["cotrain-clip"]
            clip_cells += (
                f"| {k['seconds']:.2f} s | {k['ratio']:.3f} | **{k['seconds'] / c['seconds']:.3f}** "
            )
        print(
            f"| {r['n']} | {r['rate']:g} Mbit/s | {r['dtype']} | {r['message_mb']:.1f} MB "
            f"| {r['bound']:.2f} s "
            f"| {c['seconds']:.2f} s | **{c['ratio']:.3f}** {clip_cells}"
            f"| {h['seconds']:.2f} s | {h['ratio']:.3f} "
            f"| {c['seconds'] / h['seconds']:.3f} | {r['tcp_floor']:.3f} "
            f"| {r['tcp_exchange']:.3f} / {r['libp2p_exchange']:.3f} | {c['busy']:.0%} / {h['busy']:.0%} "
            f"| {c['machine']:.2f} / {c['ours']:.2f} |"
        )
    print()
    for dtype in sorted({r["dtype"] for r in rows}):
        errs = [r[arm]["err"] for r in rows if r["dtype"] == dtype for arm in arms]
        failed = sum(r[arm]["failed"] for r in rows if r["dtype"] == dtype for arm in arms)
        print(
            f"{dtype}: largest relative error against the true mean {max(errs):.1e}, failed rounds {failed}"
        )
    worst = max(r[main]["ratio"] for r in rows)
    beats = all(r[main]["seconds"] <= r["hivemind"]["seconds"] * 1.02 for r in rows)
    print(
        f"Goal: ratio <= {GOAL} at every n ({'met' if worst <= GOAL else 'NOT met'}: worst {worst:.3f}); "
        f"cotrain at least as fast as hivemind's averager: {'yes' if beats else 'no'} (within 2%)"
    )
    if over:
        gain = [r["cotrain-libp2p"]["seconds"] / r[main]["seconds"] for r in rows]
        print(f"cotrain over libp2p / cotrain direct: {', '.join(f'{g:.3f}' for g in gain)} (row by row)")
    if clip:
        slowest = max(r["cotrain-clip"]["seconds"] / r["cotrain"]["seconds"] for r in rows)
        print(
            f"Goal: centered-clip at most {CLIP_GOAL - 1:.0%} slower than the mean "
            f"({'met' if slowest <= CLIP_GOAL else 'NOT met'}: worst {slowest:.3f})"
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8], help="group sizes to run")
    ap.add_argument("--rate", type=float, default=100.0, help="link rate, Mbit/s each way (n <= 4)")
    ap.add_argument("--rate-8", type=float, default=50.0, help="link rate for groups of more than 4 peers")
    ap.add_argument("--dtypes", nargs="+", default=["fp16", "fp32"], choices=["fp16", "fp32"])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per arm, precision and n (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per arm before those")
    ap.add_argument("--matchmaking-time", type=float, default=5.0, help="as in the albert-large-v2 preset")
    ap.add_argument("--round-timeout", type=float, default=120.0)
    ap.add_argument("--bandwidth", type=float, default=0.0, help="cotrain's --bandwidth hint (0: none)")
    ap.add_argument(
        "--part-size", type=float, default=0.0, help="KiB per part in cotrain's arm (0: cotrain's own)"
    )
    ap.add_argument(
        "--read-ahead", type=int, default=0, help="parts read ahead per stream, cotrain's arm (0: its own)"
    )
    ap.add_argument(
        "--exchanges",
        type=int,
        default=3,
        help="all-to-all exchanges of the same bytes over plain TCP and over libp2p per precision (median)",
    )
    ap.add_argument("--limit", type=float, default=1800.0, help="stop everything after this many seconds")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--logs", help="keep the peers' logs in this folder")
    ap.add_argument(
        "--congestion-control",
        default="",
        help="TCP congestion control in the namespaces (default: the machine's)",
    )
    ap.add_argument(
        "--transport",
        choices=("tcp", "quic"),
        default="tcp",
        help="the peers' libp2p transport: TCP (Noise, yamux) or QUIC (own encryption and streams, over UDP)",
    )
    ap.add_argument("--trace", help="append each round's timings and link byte counters to this JSONL file")
    ap.add_argument(
        "--aggregation",
        choices=tuple(AGGREGATION_ARMS),
        default="mean",
        help="cotrain's averager with mean or centered-clip reducers, or both side by side",
    )
    ap.add_argument(
        "--libp2p-arm",
        action="store_true",
        help="also cotrain's averager without its direct TCP path (arm cotrain-libp2p), in the same rounds",
    )
    ap.add_argument("--quick", action="store_true", help="2 and 4 peers, fp16, 1 round per arm")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--group-size", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--initial-peer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="", help=argparse.SUPPRESS)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.peers, args.dtypes, args.rounds = [2, 4], ["fp16"], 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peer:
        return peer_main(args)
    netns.prepare_namespaces("allreduce.py", args.limit)
    started = netns.print_started()
    rows = []
    tmp = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="cotrain-allreduce-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        shapes_file = tmp / "shapes.json"
        shapes_file.write_text(json.dumps(albert_large_shapes()))
        for n in args.peers:
            rate = args.rate if n <= 4 else args.rate_8
            rows += run_group(n, rate, args, shapes_file, tmp)
    except BaseException:
        print(f"peers' logs kept in {tmp}", file=sys.stderr)
        raise
    if not args.logs:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    netns.print_finished(started)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
