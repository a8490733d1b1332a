"""Several hosts on one machine for the benchmarks: network namespaces joined by a shaped bridge.

``Network(n, rate_mbit)`` creates, all named ``cotrain-bench-<pid>-...``:

- a namespace holding only a bridge (``br0``);
- one namespace per host, each with a veth pair: ``eth0`` (address ``10.213.0.<i+1>/24``) inside the host's
  namespace, ``v<i>`` on the bridge;
- a ``tbf`` qdisc at ``rate_mbit`` (or the host's entry of ``rates``) on both ends of every veth: ``eth0``
  limits what the host sends (its upload), ``v<i>`` what it receives (its download). The kernel has no
  ``netem``: no added latency or loss.
- TCP congestion control in every host's namespace: ``congestion`` if given (one of the machine's
  ``net.ipv4.tcp_allowed_congestion_control``: a namespace may set no other), else what a new namespace
  inherits from the machine; ``congestion_control()`` says which.
- hosts behind NAT (``add_nat_host``): a home network behind one of the hosts, which masquerades for it.

Nothing is created in the machine's own namespace and the addresses exist only inside these namespaces.
``close()`` (also on exit from ``with``) kills every process still running inside them and deletes them;
``remove_stale()`` deletes namespaces left by a run of these scripts whose process no longer exists (a
``kill -9``). ``install_exit_handlers`` turns SIGTERM/SIGHUP and a global time limit into exceptions, so
``finally`` blocks and ``with`` exits run on Ctrl+C, on errors and when the time is up.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PREFIX = "cotrain-bench"
SUBNET = "10.213.0"
NAT_SUBNET = "10.214"  # home networks behind NAT: 10.214.<k>.0/24
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_OURS = re.compile(rf"^{PREFIX}-(\d+)-")
TAG = "@@"  # marks the lines a peer process writes for the benchmark on its stdout


def valid_netns_name(name: str) -> bool:
    """A name `ip netns` stores as a plain file in /run/netns: letters, digits, '_', '.', '-'; no path."""
    return bool(_NAME.fullmatch(name)) and name not in (".", "..")


def allreduce_bound_s(n: int, message_bytes: float, rate_bits_per_s: float) -> float:
    """Lower bound of an all-reduce of ``message_bytes`` among ``n`` peers, each with a full-duplex link of
    ``rate_bits_per_s``: every peer must send (and receive) 2(n-1)/n of the message (reduce-scatter then
    all-gather; hivemind's butterfly all-reduce moves exactly this much)."""
    if n < 2:
        return 0.0
    return 2 * (n - 1) / n * message_bytes * 8 / rate_bits_per_s


def _run(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30, input=input)


def list_netns() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    out = _run("ip", "netns", "pids", name, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def kill_pids(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive or sig == signal.SIGKILL:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_exists(p) for p in alive):
            time.sleep(0.1)
        pids = [p for p in alive if _exists(p)]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return False


def delete_netns(name: str) -> None:
    kill_pids(netns_pids(name))
    _run("ip", "netns", "delete", name, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces of earlier benchmark runs whose process has gone (killed with SIGKILL)."""
    removed = []
    for name in list_netns():
        m = _OURS.match(name)
        if m and not _exists(int(m.group(1))):
            delete_netns(name)
            removed.append(name)
    return removed


@dataclass
class Network:
    hosts: int
    rate_mbit: float
    burst_bytes: int = 64 * 1024
    queue_ms: int = 50
    congestion: str = ""
    rates: list[float] | None = None  # per host, Mbit/s each way; default rate_mbit for every host
    tag: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}")
    created: list[str] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)  # processes seen in the namespaces (remember_pids)
    nat: dict[int, str] = field(default_factory=dict)  # host behind NAT -> its private address
    routers: set[int] = field(default_factory=set)  # hosts that masquerade for a home network

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def host_ns(self, i: int) -> str:
        return f"{self.tag}-h{i}"

    def address(self, i: int) -> str:
        return self.nat.get(i) or f"{SUBNET}.{i + 1}"

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.host_ns(i), *argv]

    def __enter__(self) -> Network:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        if not valid_netns_name(name):
            raise ValueError(f"invalid network namespace name {name!r}")
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        _run(
            "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{rate_mbit}mbit", "burst", str(self.burst_bytes), "latency", f"{self.queue_ms}ms",
        )  # fmt: skip

    def create(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError("hosts must be between 1 and 200")
        if self.rates is not None and len(self.rates) != self.hosts:
            raise ValueError(f"{len(self.rates)} rates for {self.hosts} hosts")
        br = self.bridge_ns
        self._add_ns(br)
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns = self.host_ns(i)
            self._add_ns(ns)
            _run("ip", "-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", br, "link", "set", f"v{i}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            if self.congestion:
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "sysctl",
                    "-qw",
                    f"net.ipv4.tcp_congestion_control={self.congestion}",
                )
            rate = self.rate(i)
            if rate > 0:
                self.shape(ns, "eth0", rate)
                self.shape(br, f"v{i}", rate)

    def add_nat_host(self, router: int) -> int:
        """A host behind a NAT, as a volunteer's machine behind a home router: a namespace of its own joined
        by a veth pair (``eth0`` there, ``lan<k>`` at the router) to host ``router``, with a private address
        (``10.214.<k>.2/24``, the router's end ``.1``) and its default route through the router. The router
        forwards what the home host sends, masquerading it as its own address on the bridge (nftables), and
        forwards nothing that starts outside: the home host dials out and cannot be dialed (no port
        forwarding). Returns the host's index, which ``host_ns``, ``address`` and ``exec_argv`` take. Needs
        the ``nft`` command (Debian's nftables)."""
        if not 0 <= router < self.hosts:
            raise ValueError(f"router must be one of the {self.hosts} hosts on the bridge")
        k = len(self.nat)
        i = self.hosts + k
        ns, rns, lan = self.host_ns(i), self.host_ns(router), f"lan{k}"
        self._add_ns(ns)
        _run("ip", "-n", rns, "link", "add", lan, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", rns, "addr", "add", f"{NAT_SUBNET}.{k}.1/24", "dev", lan)
        _run("ip", "-n", rns, "link", "set", lan, "up")
        _run("ip", "-n", ns, "addr", "add", f"{NAT_SUBNET}.{k}.2/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"{NAT_SUBNET}.{k}.1")
        if router not in self.routers:
            _run("ip", "netns", "exec", rns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run("ip", "netns", "exec", rns, "nft", "-f", "-", input=NAT_RULES)
            self.routers.add(router)
        self.nat[i] = f"{NAT_SUBNET}.{k}.2"
        return i

    def rate(self, i: int) -> float:
        """Host i's link rate, Mbit/s each way (0: not shaped)."""
        return self.rates[i] if self.rates else self.rate_mbit

    def congestion_control(self) -> str:
        """The TCP congestion control of the hosts' namespaces."""
        argv = self.exec_argv(0, ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"])
        return _run(*argv).stdout.strip()

    def close(self) -> None:
        """Kill everything still running in the namespaces, then delete them (their veths go with them), and
        remove the shared-memory files those processes leave (``remove_shared_memory``)."""
        self.remember_pids()
        for name in reversed(self.created):
            delete_netns(name)
        self.created.clear()
        remove_shared_memory(sorted(self.seen))

    def remember_pids(self) -> None:
        """Note the processes now running in the namespaces, whose shared memory ``close`` removes."""
        self.seen.update(pid for name in self.created for pid in netns_pids(name))


# a home router: what its LANs send out of eth0 leaves with the router's address; of what comes in on eth0
# only the replies to connections opened from inside are forwarded
NAT_RULES = """
table ip cotrain_nat {
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "eth0" masquerade
  }
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan*" oifname "eth0" accept
  }
}
"""


def tcp_connects(
    net: Network, src: int, address: str, dst: int, port: int = 5203, timeout: float = 3
) -> bool:
    """Whether host ``src`` opens a TCP connection to ``address``:``port`` while host ``dst`` listens on that
    port (on every address it has): what a NAT lets through."""
    import sys

    listen = (
        "import socket\n"
        "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        f"s.bind(('0.0.0.0',{port}));s.listen(1);print('ready',flush=True)\n"
        f"s.settimeout({timeout + 2});s.accept()\n"
    )
    dial = f"import socket\nsocket.create_connection(('{address}',{port}),timeout={timeout})\n"
    server = start_in_ns(net, dst, [sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("TCP test listener did not start")
        client = subprocess.run(net.exec_argv(src, [sys.executable, "-c", dial]), capture_output=True,
                                timeout=timeout + 10)  # fmt: skip
        return client.returncode == 0
    finally:
        stop_process(server, grace=1)


def remove_shared_memory(pids: list[int]) -> None:
    """Delete the torch shared-memory files (``/dev/shm/torch_<pid>_*``) of these processes once they are
    gone: a process killed together with its ``torch_shm_manager`` leaves them behind, holding RAM."""
    from cotrain.host.shm import remove_leftovers

    remove_leftovers(pids)


class TimeUp(Exception):
    """The benchmark's overall time limit passed."""


def install_exit_handlers(limit_s: float | None) -> None:
    """Ctrl+C/SIGTERM/SIGHUP -> KeyboardInterrupt, and a time limit -> TimeUp, raised once in the main thread
    so that cleanup code runs; later signals are ignored while it does."""

    raised = []

    def interrupt(signum, frame):
        if raised:  # cleanup is under way: a second signal (e.g. from a `timeout` wrapper) must not stop it
            return
        raised.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    def time_up(signum, frame):
        if raised:
            return
        raised.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise TimeUp(f"time limit of {limit_s:.0f} s reached")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    if limit_s:
        signal.signal(signal.SIGALRM, time_up)
        signal.alarm(max(1, int(limit_s)))


def die_with_parent() -> None:
    """In a child before exec: a session of its own (the terminal's Ctrl+C reaches only the benchmark, which
    stops its children in order), and SIGTERM when the benchmark itself dies, even by SIGKILL."""
    import ctypes

    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_in_ns(net: Network, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
    """Start a process inside host i's namespace (see ``die_with_parent``)."""
    return subprocess.Popen(net.exec_argv(i, argv), preexec_fn=die_with_parent, **kwargs)


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tcp_goodput_mbit(net: Network, a: int, b: int, megabytes: int = 8, timeout: float = 60.0) -> float:
    """Application-level throughput (Mbit/s of payload) of two TCP flows at once, a -> b and b -> a, as in an
    all-reduce where every link carries data both ways: the most any protocol over TCP gets from the shaped
    links, TCP/IP and Ethernet headers and the other flow's ACKs taken off. The mean of the two flows."""
    import sys

    port = 5201

    def server(host: int) -> str:
        return (
            "import socket,time\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('{net.address(host)}',{port}));s.listen(1);print('ready',flush=True)\n"
            "c,_=s.accept();n=0;t0=None\n"
            "while True:\n"
            " b=c.recv(1<<20)\n"
            " if t0 is None:t0=time.perf_counter()\n"
            " if not b:break\n"
            " n+=len(b)\n"
            "print(n*8/(time.perf_counter()-t0)/1e6,flush=True)\n"
        )

    def client(host: int) -> str:
        return (
            "import socket\n"
            f"s=socket.create_connection(('{net.address(host)}',{port}));buf=bytes(1<<20)\n"
            f"for _ in range({megabytes}):s.sendall(buf)\n"
            "s.close()\n"
        )

    servers = [start_in_ns(net, h, [sys.executable, "-c", server(h)], stdout=subprocess.PIPE, text=True)
               for h in (a, b)]  # fmt: skip
    clients = []
    try:
        for srv in servers:
            if srv.stdout.readline().strip() != "ready":
                raise RuntimeError("TCP test server did not start")
        clients = [
            start_in_ns(net, src, [sys.executable, "-c", client(dst)]) for src, dst in ((a, b), (b, a))
        ]
        rates = []
        for proc in clients:
            proc.wait(timeout=timeout)
        for srv in servers:
            out, _ = srv.communicate(timeout=timeout)
            rates.append(float(out.strip().splitlines()[-1]))
        return sum(rates) / len(rates)
    finally:
        for proc in [*clients, *servers]:
            stop_process(proc, grace=2)


EXCHANGE_PEER = """
import socket, sys, threading, time
me, addrs, size, port = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((addrs[me], port))
server.listen(len(addrs))
print("listening", flush=True)
inbound, ends = [], []
def accept():
    for _ in range(len(addrs) - 1):
        inbound.append(server.accept()[0])
acceptor = threading.Thread(target=accept)
acceptor.start()
sys.stdin.readline()  # every peer listens: connect
outbound = [socket.create_connection((a, port)) for j, a in enumerate(addrs) if j != me]
acceptor.join()
print("connected", flush=True)
at = float(sys.stdin.readline())
time.sleep(max(0.0, at - time.time()))
def send(conn):
    block, left = memoryview(bytes(1 << 20)), size
    while left > 0:
        conn.sendall(block[: min(left, len(block))])
        left -= min(left, len(block))
    conn.shutdown(socket.SHUT_WR)
def receive(conn):
    got = 0
    while chunk := conn.recv(1 << 20):
        got += len(chunk)
    ends.append((time.time(), got))
threads = [threading.Thread(target=send, args=(c,)) for c in outbound]
threads += [threading.Thread(target=receive, args=(c,)) for c in inbound]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(max(t for t, _ in ends), sum(g for _, g in ends), flush=True)
"""


def tcp_exchange_s(net: Network, bytes_per_flow: int, port: int = 5202, timeout: float = 300.0) -> float:
    """Seconds for every host to send ``bytes_per_flow`` to every other host over plain TCP, all flows at once
    (n - 1 out and n - 1 in per host, connections opened beforehand), until the last byte has arrived: the
    all-reduce's traffic with nothing between the flows (no framing, encryption, multiplexing or waiting for
    other peers' parts). With 2 x message / n per flow each host moves 2(n-1)/n x message each way, exactly
    what the butterfly all-reduce moves: this time over the bound is what TCP alone achieves on the links."""
    import sys

    addrs = ",".join(net.address(i) for i in range(net.hosts))
    procs = [
        start_in_ns(
            net,
            i,
            [sys.executable, "-c", EXCHANGE_PEER, str(i), addrs, str(bytes_per_flow), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(net.hosts)
    ]
    try:
        for stage in ("listening", "connected"):
            for proc in procs:
                if proc.stdout.readline().strip() != stage:
                    raise RuntimeError(f"TCP exchange peer failed before {stage!r}")
            if stage == "listening":
                for proc in procs:
                    proc.stdin.write("connect\n")
                    proc.stdin.flush()
        start = time.time() + 0.5
        for proc in procs:
            proc.stdin.write(f"{start}\n")
            proc.stdin.flush()
        ends = []
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            end, got = out.split()
            if int(got) != bytes_per_flow * (net.hosts - 1):
                raise RuntimeError(f"a TCP exchange peer received {got} bytes, not {bytes_per_flow} per flow")
            ends.append(float(end))
        return max(ends) - start
    finally:
        for proc in procs:
            stop_process(proc, grace=2)


class LinkCounters:
    """Byte counters of every host's link, sampled 20 times a second by a small process in the bridge's
    namespace: (monotonic time, [(bytes the host sent, bytes it received) for each host])."""

    def __init__(self, net: Network, period: float = 0.05):
        import sys
        import threading

        code = (
            "import sys,time\n"
            f"n={net.hosts}\n"
            "def rd(i,k):\n"
            " with open(f'/sys/class/net/v{i}/statistics/{k}_bytes') as f: return f.read().strip()\n"
            "while True:\n"
            " print(time.monotonic(),*[rd(i,k) for i in range(n) for k in ('rx','tx')],flush=True)\n"
            f" time.sleep({period})\n"
        )
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", net.bridge_ns, sys.executable, "-c", code],
            stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []

        def read() -> None:
            for line in self.proc.stdout:
                parts = line.split()
                values = [int(x) for x in parts[1:]]
                self.samples.append((float(parts[0]), list(zip(values[::2], values[1::2], strict=True))))

        threading.Thread(target=read, daemon=True).start()

    def between(self, t0: float, t1: float) -> list[tuple[int, int]]:
        """Bytes each host sent and received between t0 and t1 (nearest samples outside the window)."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return []
        a, b = before[-1][1], after[0][1]
        return [(b[i][0] - a[i][0], b[i][1] - a[i][1]) for i in range(len(a))]

    def close(self) -> None:
        stop_process(self.proc, grace=1)


# ------------------------------------------------------------------------------- processes in the namespaces


def say(**msg) -> None:
    """A peer process's message to the benchmark (one JSON line on stdout)."""
    print(TAG + json.dumps(msg), flush=True)


def simulated_peer(run, peer, model, connection, optimizer=None):
    """A ``cotrain.SwarmPeer`` of a peer process around ``model``, with the preset's optimizer (or
    ``optimizer``: params -> optimizer) and schedule, joined through ``connection``; its compute is the
    benchmark's to simulate (``fixed_gradients``)."""
    from cotrain.engine import SwarmPeer
    from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory

    return SwarmPeer(
        model,
        config=(run, peer),
        connection=connection,
        params=parameter_groups(model, run.weight_decay),
        optimizer=optimizer or optimizer_factory(run),
        scheduler=scheduler_factory(run),
        batch_size_per_step=peer.per_device_train_batch_size * peer.gradient_accumulation_steps,
    )


def plain_model(parameters: int, block: int = 1 << 20):
    """A simulated model of ``parameters`` parameters, in plain blocks of ``block`` values (the last one
    shorter), the same on every peer (seeded, as a preset's initialization is): what a round moves, encodes
    and averages is a model of that size; it has no forward pass (the compute is simulated)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    sizes = [min(block, parameters - start) for start in range(0, parameters, block)]
    model.blocks = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02) for n in sizes
    )
    return model


def fixed_gradients(model, seed: int) -> None:
    """Random gradients on every parameter, as a backward pass would leave them, kept for every step (nothing
    zeroes them): the simulated compute's gradients."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-4


class Peers:
    """The n peer processes, each in its namespace, spoken to with JSON lines over stdin/stdout."""

    def __init__(self, net: Network, argv: list[str], logdir: Path, cwd: Path | None = None):
        self.net, self.argv, self.logdir, self.cwd = net, argv, logdir, cwd
        self.procs: list[subprocess.Popen] = []
        self.inbox: list[queue.Queue] = []

    def start(self, i: int, extra: list[str]) -> None:
        log = open(self.logdir / f"peer{i}.log", "w")
        proc = start_in_ns(
            self.net,
            i,
            [*self.argv, "--index", str(i), "--address", self.net.address(i), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=self.cwd,
        )
        inbox: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                if line.startswith(TAG):
                    inbox.put(json.loads(line[len(TAG) :]))
            inbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        self.procs.append(proc)
        self.inbox.append(inbox)

    def send(self, cmd: dict, only: int | None = None) -> None:
        for i, proc in enumerate(self.procs):
            if only is None or i == only:
                proc.stdin.write(json.dumps(cmd) + "\n")
                proc.stdin.flush()

    def receive(self, i: int, timeout: float) -> dict:
        try:
            msg = self.inbox[i].get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"peer {i} did not answer within {timeout:.0f} s; see {self.logdir}") from None
        if msg is None:
            tail = (self.logdir / f"peer{i}.log").read_text()[-2000:]
            raise RuntimeError(f"peer {i} exited; the end of its log:\n{tail}")
        return msg

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def stop(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            stop_process(proc, grace=3)


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def tree_cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    t = proc.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
    return total


class CpuSampler(threading.Thread):
    """Samples (monotonic time, machine busy CPU seconds, our processes' CPU seconds) every 0.2 s."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids, self.samples, self.stopped = pids, [], threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((time.monotonic(), busy_seconds(), tree_cpu_seconds(self.pids())))
            self.stopped.wait(0.2)

    def cores(self, t0: float, t1: float) -> tuple[float, float]:
        """(machine, ours) busy cores between t0 and t1, from the samples around the window."""
        inside = [s for s in self.samples if t0 - 0.2 <= s[0] <= t1 + 0.2]
        if len(inside) < 2:
            return float("nan"), float("nan")
        a, b = inside[0], inside[-1]
        span = b[0] - a[0]
        return (b[1] - a[1]) / span, (b[2] - a[2]) / span


def print_started() -> float:
    """Print when, where and under what load a benchmark starts; returns its start time (time.time())."""
    import datetime
    import platform

    load = os.getloadavg()
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    return time.time()


def print_finished(started: float) -> None:
    """Print how long a benchmark took and the load average after it."""
    load = os.getloadavg()
    print(
        f"took {time.time() - started:.0f} s; load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


@contextlib.contextmanager
def logs_folder(prefix: str, keep: bool):
    """A new temporary folder for a benchmark's logs: kept, and its path printed, when the benchmark fails or
    ``keep`` says so; removed otherwise."""
    import shutil
    import sys
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    except BaseException:
        print(f"logs kept in {tmp}", file=sys.stderr)
        raise
    if keep:
        print(f"logs kept in {tmp}", flush=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_namespaces(script: str, limit_s: float) -> None:
    """A namespace benchmark's start: root and iproute2 checked, exit handlers installed, namespaces of an
    earlier run that died removed."""
    import shutil
    import sys

    if os.geteuid() != 0 or not shutil.which("tc"):
        sys.exit(f"{script} needs root and iproute2 (ip, tc) to create network namespaces")
    install_exit_handlers(limit_s)
    removed = remove_stale()
    if removed:
        print(f"removed namespaces left by an earlier run: {', '.join(removed)}")
