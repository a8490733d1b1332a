"""Relays and hole punching, tried with a large transfer: can a peer behind NAT be reached through a relay?

The hosts are network namespaces on one machine (``benchmarks/lib/netns.py``), links shaped to ``--rate``
Mbit/s both ways: a public relay on ``h0`` (hivemind's p2pd, forced public: it offers libp2p's relay
v2), a public peer on ``h1``, and two home hosts, each behind a home router of its own that
masquerades what it sends and forwards nothing that starts outside (nftables, as in ``benchmarks/nat.py``).
Every peer is a bare hivemind ``P2P`` (the daemon cotrain's peers run) in a process of its own, inside its
host's namespace.

The home peer A reserves a slot on the relay (``use_relay``, ``use_auto_relay``, ``trusted_relays``: the
relay, ``force_reachability="private"``) and waits for its ``/p2p-circuit`` address. Then, per arm, a sender
dials A at that address (or, where A announced none, at ``RELAY/p2p-circuit/p2p/A``) and streams
``--megabytes`` to it; A counts what arrives and answers the count:

- ``public``: the sender is the public peer (one side can listen: the daemon may reverse the connection);
- ``nat``: the sender is the other home peer B, behind its own NAT (a direct connection needs hole punching).

With ``--dht`` every peer is a hivemind ``DHT`` set up as hivemind's own relay test sets its peers up (the
relay with ``use_relay``, ``use_auto_relay`` and ``force_reachability="public"``; A and the senders with
``use_relay`` and ``use_auto_relay``, the relay their initial peer), and a sender finds A by its peer id alone
(DHT pings, for up to a minute, as that test does) before it opens the stream.

Reported per arm: whether A announced a circuit address and after how long, whether the sender connected,
the bytes A received, the seconds the transfer took, and the addresses of the connection the stream used
(``/p2p-circuit`` in it: relayed; otherwise direct, i.e. reversed or punched). A transfer that stops short
says where and why (go-libp2p's relay v2 limits a relayed connection to 128 KiB or 2 minutes by default).

    python benchmarks/relay.py [--megabytes 200] [--rate 100] [--no-listen] [--dht] [--keep-logs]

Needs root, iproute2 and nftables. The last line is ``{"event": "relay_summary", "arms": {"public": {...},
"nat": {...}}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import netns  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RELAY, PUBLIC, ROUTER_A, ROUTER_B = 0, 1, 2, 3
HANDLE = "cotrain-relay-benchmark"
CHUNK = 1 << 20


# --- the peers (run inside the namespaces: python relay.py --role ...) ----------------------------------


async def _host(listen: str, relay: str | None, private: bool, no_listen: bool = False):
    from hivemind.p2p import P2P

    options = {"force_reachability": "private" if private else "public", "nat_port_map": False}
    if no_listen:  # a host that listens on nothing (libp2p then relies on relays and reversed dials)
        relays = {"initial_peers": [relay], "trusted_relays": [relay], "use_auto_relay": True}
        return await P2P.create(host_maddrs=[], no_listen=True, use_relay=True, **options, **relays)
    if relay:
        options["initial_peers"] = [relay]
    if relay and private:  # (the daemon refuses trusted relays without auto-relay)
        options.update(trusted_relays=[relay], use_auto_relay=True)
    return await P2P.create(host_maddrs=[f"/ip4/{listen}/tcp/0"], use_relay=True, **options)


def stream_counter(out: str):
    """A's stream handler: read the length a sender announces, then that many bytes, answer the count, and
    write what each stream brought (bytes, seconds or error, the connection's address) to ``out``."""
    received: list[dict] = []

    async def handler(info, reader, writer) -> None:
        started, count = time.monotonic(), 0
        try:
            total = int.from_bytes(await reader.readexactly(8), "big")  # the sender says how much comes
            while count < total and (data := await reader.read(min(CHUNK, total - count))):
                count += len(data)
            writer.write(count.to_bytes(8, "big"))
            await writer.drain()
            received.append({"bytes": count, "seconds": round(time.monotonic() - started, 2)})
        except Exception as e:
            received.append({"bytes": count, "error": f"{type(e).__name__}: {e}"[:300]})
        received[-1]["addr"] = str(info.addr)
        _write(out, received)
        writer.close()

    return handler


async def send_counted(reader, writer, megabytes: int, result: dict, started: float) -> None:
    """Stream ``megabytes`` MiB to A's ``stream_counter`` (the length first: no half-close) and read the count
    it answers, into ``result``."""
    chunk = b"\0" * CHUNK
    writer.write((megabytes * CHUNK).to_bytes(8, "big"))
    for _ in range(megabytes):
        writer.write(chunk)
        await asyncio.wait_for(writer.drain(), 120)
        result["bytes_sent"] += CHUNK
    count = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 120), "big")
    result["bytes_received_by_target"] = count
    result["seconds"] = round(time.monotonic() - started, 2)
    result["mbit_s"] = round(count * 8 / 1e6 / max(result["seconds"], 1e-9), 1)


async def relay_role(args) -> None:
    p2p = await _host(args.listen, None, private=False)
    _write(args.out, {"id": str(p2p.peer_id), "maddrs": [str(m) for m in await p2p.get_visible_maddrs()]})
    while not Path(args.stop).exists():
        await asyncio.sleep(0.5)
    await p2p.shutdown()


async def receiver_role(args) -> None:
    """A: reserve a slot on the relay, announce the circuit address, count what each stream brings."""
    p2p = await _host(args.listen, args.relay, private=True, no_listen=args.no_listen)
    await p2p.add_binary_stream_handler(HANDLE, stream_counter(args.out + ".received"))
    started = time.monotonic()
    circuit: list[str] = []
    while time.monotonic() - started < args.wait and not circuit:
        try:
            visible = await p2p.get_visible_maddrs(latest=True)
        except ValueError:  # none yet (a host that listens on nothing)
            visible = []
        circuit = [str(m) for m in visible if "p2p-circuit" in str(m)]
        await asyncio.sleep(1.0)
    after = round(time.monotonic() - started, 1) if circuit else None
    _write(args.out, {"id": str(p2p.peer_id), "circuit": circuit, "circuit_after_s": after})
    while not Path(args.stop).exists():
        await asyncio.sleep(0.5)
    await p2p.shutdown()


async def sender_role(args) -> None:
    """Dial A at its circuit address and stream ``megabytes`` to it."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from cotrain.hivemind_ext.hooks import p2p_client

    target = json.loads(Path(args.target).read_text())
    result: dict = {"connected": False, "stream_opened": False, "bytes_sent": 0}
    started = time.monotonic()
    p2p = None
    try:
        p2p = await _host(args.listen, args.relay, private=args.private)
        peer = PeerID.from_base58(target["id"])
        # the circuit addresses A announced, or, where it announced none, the one through the relay it was
        # told to use (a reservation may exist that the daemon does not list)
        circuit = target["circuit"] or [f"{args.relay}/p2p-circuit"]
        addresses = [Multiaddr(a.split(f"/p2p/{target['id']}")[0]) for a in circuit]
        result["dialed"] = [str(a) for a in addresses]
        try:
            await asyncio.wait_for(p2p_client(p2p).connect(peer, addresses), 60)
        except Exception as e:  # then the daemon's own routing (its libp2p DHT, the relay's peer records)
            result["connect_error"] = f"{type(e).__name__}: {e}"[:300]
        result["connected"] = "connect_error" not in result
        result["connect_s"] = round(time.monotonic() - started, 2)
        info, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, HANDLE), 60)
        result["stream_opened"] = True
        result["stream_addr"] = str(info.addr)
        started = time.monotonic()
        await send_counted(reader, writer, args.megabytes, result, started)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:400]
        result["seconds"] = round(time.monotonic() - started, 2)
    if p2p is not None:
        peers = await p2p.list_peers()
        result["connections_to_target"] = [
            str(a) for p in peers if str(p.peer_id) == target["id"] for a in p.addrs
        ]
    _write(args.out, result)
    if p2p is not None:
        await p2p.shutdown()


def _dht(listen: str, relay: str | None, public: bool, no_listen: bool = False):
    """A hivemind DHT as hivemind's relay test starts its peers (``--dht``)."""
    import hivemind

    options = {"use_relay": True, "use_auto_relay": True, "nat_port_map": False, "start": True}
    if public:
        options["force_reachability"] = "public"
    if relay:
        options["initial_peers"] = [relay]
    if no_listen:
        options.update(host_maddrs=[], no_listen=True)
    else:
        options["host_maddrs"] = [f"/ip4/{listen}/tcp/0"]
    return hivemind.DHT(**options)


async def _count_streams(dht, node, out: str) -> list[str]:
    """(In A's DHT process) count what each stream brings, as ``receiver_role`` does; A's addresses."""
    await node.p2p.add_binary_stream_handler(HANDLE, stream_counter(out + ".received"))
    try:
        return [str(m) for m in await node.p2p.get_visible_maddrs(latest=True)]
    except ValueError:
        return []


async def _ping(dht, node, peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    return bool(await node.protocol.call_ping(PeerID.from_base58(peer_id)))


async def _stream(dht, node, peer_id: str, megabytes: int) -> dict:
    from hivemind.p2p import PeerID

    peer, result = PeerID.from_base58(peer_id), {"bytes_sent": 0}
    started = time.monotonic()
    try:
        info, reader, writer = await asyncio.wait_for(node.p2p.call_binary_stream_handler(peer, HANDLE), 60)
        result["stream_opened"], result["stream_addr"] = True, str(info.addr)
        await send_counted(reader, writer, megabytes, result, started)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:400]
        result["seconds"] = round(time.monotonic() - started, 2)
    peers = await node.p2p.list_peers()
    result["connections_to_target"] = [str(a) for p in peers if str(p.peer_id) == peer_id for a in p.addrs]
    return result


def dht_role(args) -> None:
    """``--dht``: the relay, A or a sender as a hivemind DHT."""
    from functools import partial

    public = args.role == "relay" or (args.role == "sender" and not args.private)
    no_listen = args.role == "receiver" and args.no_listen
    dht = _dht(args.listen, args.relay, public=public, no_listen=no_listen)
    if args.role == "relay":
        _write(args.out, {"id": str(dht.peer_id), "maddrs": [str(m) for m in dht.get_visible_maddrs()]})
    elif args.role == "receiver":
        time.sleep(5)  # as hivemind's test waits before its other peer starts
        addresses = dht.run_coroutine(partial(_count_streams, out=args.out))
        circuit = [a for a in addresses if "p2p-circuit" in a]
        after = 5.0 if circuit else None
        _write(args.out, {"id": str(dht.peer_id), "circuit": circuit, "circuit_after_s": after,
                          "addresses": addresses})  # fmt: skip
    else:
        target = json.loads(Path(args.target).read_text())
        result: dict = {"connected": False}
        started = time.monotonic()
        while time.monotonic() - started < 60 and not result["connected"]:
            try:
                result["connected"] = dht.run_coroutine(partial(_ping, peer_id=target["id"]))
            except Exception as e:
                result["ping_error"] = f"{type(e).__name__}: {e}"[:300]
            if not result["connected"]:
                time.sleep(2)
        result["connect_s"] = round(time.monotonic() - started, 2)
        result.update(dht.run_coroutine(partial(_stream, peer_id=target["id"], megabytes=args.megabytes)))
        _write(args.out, result)
    while args.role != "sender" and not Path(args.stop).exists():
        time.sleep(0.5)
    dht.shutdown()


def _write(path: str, value) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


# --- the driver -----------------------------------------------------------------------------------------


def _wait_file(path: Path, seconds: float, procs: list) -> dict:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{path.name} was not written within {seconds:.0f} s")
        time.sleep(0.5)
    return json.loads(path.read_text())


def role_argv(name: str, root: Path, listen: str, dht: bool, extra: list[str]) -> list[str]:
    """The process of role ``name`` (``relay``, ``receiver``, ``sender-ARM``): this script with ``--role``,
    listening on ``listen``, writing what it saw to ``root``/NAME.json, stopping once ``root``/stop exists."""
    return [sys.executable, str(Path(__file__).resolve()), "--role", name.split("-")[0], "--stop",
            str(root / "stop"), "--out", str(root / f"{name}.json"), "--listen", listen,
            *(["--dht"] if dht else []), *extra]  # fmt: skip


def run(args: argparse.Namespace, root: Path) -> dict:
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    stop = root / "stop"  # the file role_argv names: every role stops once it exists
    procs = []
    results: dict = {}
    with netns.Network(4, args.rate) as net:
        home_a, home_b = net.add_nat_host(ROUTER_A), net.add_nat_host(ROUTER_B)
        results["reach"] = {
            "a_dials_out": netns.tcp_connects(net, home_a, net.address(RELAY), RELAY),
            "a_dialed_from_public": netns.tcp_connects(net, PUBLIC, net.address(home_a), home_a),
            "a_dialed_from_b": netns.tcp_connects(net, home_b, net.address(home_a), home_a),
        }

        def start(name: str, host: int, extra: list[str]) -> None:
            log = open(root / f"{name}.log", "w")
            listen = "0.0.0.0" if host in net.nat else net.address(host)
            argv = role_argv(name, root, listen, args.dht, extra)
            procs.append(netns.start_in_ns(net, host, argv, stdout=log, stderr=log, env=env, cwd=REPO))

        try:
            start("relay", RELAY, [])
            relay_info = _wait_file(root / "relay.json", 60, procs)
            relay = next(m for m in relay_info["maddrs"] if f"/{net.address(RELAY)}/" in m)
            relay = relay if "/p2p/" in relay else f"{relay}/p2p/{relay_info['id']}"
            start(
                "receiver",
                home_a,
                ["--relay", relay, "--wait", str(args.wait), *(["--no-listen"] if args.no_listen else [])],
            )
            target = _wait_file(root / "receiver.json", args.wait + 60, procs)
            results["circuit"] = {"announced": bool(target["circuit"]), "after_s": target["circuit_after_s"],
                                  "addresses": target["circuit"]}  # fmt: skip
            for arm, host, private in (("public", PUBLIC, False), ("nat", home_b, True)):
                flags = ["--relay", relay, "--target", str(root / "receiver.json"), "--megabytes",
                         str(args.megabytes), *(["--private"] if private else [])]  # fmt: skip
                start(f"sender-{arm}", host, flags)
                results[arm] = _wait_file(root / f"sender-{arm}.json", 600, procs[-1:])
                received = root / "receiver.json.received"
                results[arm]["target_saw"] = (
                    json.loads(received.read_text())[-1] if received.exists() else None
                )
        finally:
            stop.touch()
            net.remember_pids()
            for proc in reversed(procs):
                netns.stop_process(proc, grace=10)
    return results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["relay", "receiver", "sender"], help=argparse.SUPPRESS)
    ap.add_argument("--listen", help=argparse.SUPPRESS)
    ap.add_argument("--relay", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--stop", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--private", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--megabytes", type=int, default=200, help="MiB each sender streams")
    ap.add_argument("--rate", type=float, default=100.0, help="Mbit/s of every link, each way")
    ap.add_argument("--wait", type=float, default=60.0, help="seconds A waits for its circuit address")
    ap.add_argument(
        "--no-listen", action="store_true", help="A listens on nothing (hivemind's own relay test)"
    )
    ap.add_argument(
        "--dht", action="store_true", help="the peers are hivemind DHTs, set up as in hivemind's relay test"
    )
    ap.add_argument("--keep-logs", action="store_true", help="keep the peers' logs")
    ap.add_argument("--json", type=Path, help="also write the results here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role and args.dht:
        dht_role(args)
        return 0
    if args.role:
        role = {"relay": relay_role, "receiver": receiver_role, "sender": sender_role}[args.role]
        asyncio.run(role(args))
        return 0
    if not shutil.which("nft"):
        sys.exit("relay.py needs nftables for the home routers' NAT: apt-get install nftables")
    netns.prepare_namespaces("relay.py", limit_s=args.wait + 1500)
    started = netns.print_started()
    with netns.logs_folder("cotrain-relay-", args.keep_logs) as root:
        results = run(args, root)
    print(json.dumps(results, indent=1))
    print(f"\n{'arm':8s} {'connected':>9s} {'MiB received':>12s} {'seconds':>8s} {'Mbit/s':>7s}  stream over")
    for arm in ("public", "nat"):
        r = results.get(arm, {})
        got = (r.get("bytes_received_by_target") or 0) / 2**20
        over = r.get("stream_addr", "-")
        print(f"{arm:8s} {str(r.get('connected')):>9s} {got:>12.1f} {r.get('seconds', 0):>8} "
              f"{r.get('mbit_s', 0):>7}  {over}  {r.get('error', '')}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    netns.print_finished(started)
    summary = {"event": "relay_summary", "megabytes": args.megabytes, "circuit": results.get("circuit")}
    summary["arms"] = {
        arm: {
            k: results.get(arm, {}).get(k)
            for k in ("connected", "bytes_received_by_target", "seconds", "stream_addr", "error")
        }  # fmt: skip
        for arm in ("public", "nat")
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
