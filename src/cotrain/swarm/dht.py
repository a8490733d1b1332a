"""Starting a hivemind DHT with cotrain's defaults: no port mapping unless asked, clear errors."""

from __future__ import annotations

import ipaddress
import logging
import re
from multiprocessing.reduction import ForkingPickler

import hivemind
from hivemind.utils.multiaddr import Multiaddr

from cotrain.config import PeerConfig
from cotrain.errors import UserError

logger = logging.getLogger(__name__)

_OLD_STYLE = re.compile(r"^\[?([0-9a-fA-F:.]*)\]?:(\d+|\*)$")


def parse_maddrs(values: list[str], what: str) -> list[str]:
    """Validate multiaddrs; translate the seed's ``[::]:1337`` listen form; refuse bare IP:PORT peers."""
    out = []
    for value in values:
        m = _OLD_STYLE.match(value)
        if m and what != "initial peer":
            host, port = m.group(1) or "0.0.0.0", m.group(2).replace("*", "0")
            proto = "ip6" if ":" in host else "ip4"
            out.append(f"/{proto}/{host}/tcp/{port}")
            continue
        if m:
            raise UserError(
                f"initial peer {value!r} is an old-style IP:PORT address; use the full multiaddr that the "
                f"first peer prints, e.g. /ip4/{m.group(1) or '1.2.3.4'}/tcp/{m.group(2)}/p2p/PEER_ID"
            )
        try:
            Multiaddr(value)
        except Exception:
            raise UserError(
                f"malformed {what} multiaddr {value!r} (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/ID)"
            ) from None
        if what == "initial peer" and "/p2p/" not in value:
            raise UserError(
                f"initial peer {value!r} lacks its /p2p/PEER_ID part; copy the full address it prints"
            )
        out.append(value)
    return out


class _TolerantRequests:
    """The DHT process's end of its request pipe, dropping requests whose sender has exited.

    Each request carries a reply pipe that the receiving process fetches from the sender. When the
    sender (a trainer shutting down, an averager process ending) is gone before that happens, the
    plain pipe raises EOFError, which kills hivemind's DHT loop with a traceback. Nobody waits for
    such a request, so it is dropped instead."""

    def __init__(self, conn):
        self._conn, self._pending = conn, None

    def fileno(self) -> int:
        return self._conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        if self._pending is not None:
            return True
        while self._conn.poll(timeout):
            data = self._conn.recv_bytes()  # EOFError here means the pipe itself is closed: let it rise
            try:
                self._pending = ForkingPickler.loads(data)
                return True
            except (EOFError, OSError):  # its reply pipe could not be fetched from its sender
                logger.debug("Dropped a DHT request from a process that has exited")
                timeout = 0.0
        return False

    def recv(self):
        if self._pending is None and not self.poll(None):
            raise EOFError
        request, self._pending = self._pending, None
        return request

    def __getattr__(self, name):
        return getattr(self._conn, name)


class SwarmDHT(hivemind.DHT):
    """hivemind's DHT whose serving process survives requests from peers' processes that have exited."""

    def run(self) -> None:
        self._inner_pipe = _TolerantRequests(self._inner_pipe)
        super().run()


def create_dht(
    peer: PeerConfig, record_validators: list, *, client_mode: bool | None = None, wait_timeout: float = 10.0
) -> hivemind.DHT:
    """Start this process's DHT node; raise UserError with one line when the swarm cannot be reached."""
    initial_peers = parse_maddrs(peer.initial_peers, "initial peer")
    host_maddrs = parse_maddrs(peer.host_maddrs, "listen")
    announce_maddrs = parse_maddrs(peer.announce_maddrs, "announce")
    client = peer.client_mode if client_mode is None else client_mode
    try:
        return SwarmDHT(
            initial_peers=initial_peers,
            client_mode=client,
            record_validators=record_validators,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            identity_path=peer.identity_path or None,
            use_ipfs=peer.use_ipfs,
            nat_port_map=peer.nat_port_map,
            startup_timeout=peer.startup_timeout,
            wait_timeout=wait_timeout,
            start=True,
        )
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if initial_peers and ("bootstrap" in text or "initial" in text or "connect" in text):
            raise UserError(
                f"no initial peer could be reached ({', '.join(initial_peers)}): "
                f"check the addresses and that "
                f"the swarm is running"
            ) from None
        if "address already in use" in text.lower():
            raise UserError(f"cannot listen on {', '.join(host_maddrs)}: address already in use") from None
        raise UserError(f"the network layer failed to start: {text}") from None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """This peer's reachable addresses, loopback last (other machines cannot use it)."""
    addrs = [str(a) for a in dht.get_visible_maddrs()]

    def is_loopback(addr: str) -> bool:
        parts = addr.split("/")
        try:
            return len(parts) > 2 and ipaddress.ip_address(parts[2]).is_loopback
        except ValueError:
            return False

    return sorted(addrs, key=is_loopback)
