"""Starting a hivemind DHT with cotrain's defaults: no port mapping unless asked, clear errors."""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import re
import time
from pathlib import Path

import hivemind

from cotrain.errors import UserError
from cotrain.hivemind_ext.authorizer import SwarmAuthorizer, start_access_service
from cotrain.hivemind_ext.dht import SwarmDHT
from cotrain.hivemind_ext.unexported import Multiaddr
from cotrain.hivemind_ext.validators import RevocationsValidator
from cotrain.host.shm import share_by_descriptors
from cotrain.net.identity import check_identity_free, ensure_identity
from cotrain.net.probe import probe_refusal, refused_message

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


GOOGLE_DNS = ("8.8.8.8", 53)


def outbound_address(target: tuple[str, int] = GOOGLE_DNS) -> str:
    """The address this machine's route to ``target`` leaves from: a UDP socket is "connected" to it, which
    only selects the route and the source address; no packet is sent. On a machine with a public IP (a
    cloud VM, a server) that is its public address; behind NAT it is the private one."""
    import socket

    family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(target)
            return sock.getsockname()[0]
    except OSError as e:
        raise UserError(f"--use-google-dns: no route to {target[0]} here ({e.strerror})") from None


def announce_public_address(host_maddrs: list[str], target: tuple[str, int] = GOOGLE_DNS) -> list[str]:
    """Multiaddrs announcing this machine's outbound address on the TCP ports it listens on."""
    address = outbound_address(target)
    proto = "ip6" if ipaddress.ip_address(address).version == 6 else "ip4"
    ports = [m.split("/tcp/")[1].split("/")[0] for m in host_maddrs if "/tcp/" in m]
    ports = sorted({p for p in ports if p != "0"})
    if not ports:
        raise UserError(
            "--use-google-dns announces this machine's address with the port it listens on: give a fixed "
            "port, e.g. --host-maddrs /ip4/0.0.0.0/tcp/31337"
        )
    logger.info(f"This machine's outbound address is {address}; announcing it to other peers")
    return [f"/{proto}/{address}/tcp/{port}" for port in ports]


# how long a newcomer keeps starting its DHT node again while its initial peers are there but too busy to
# answer in time (at 32 trainers on 2 cores, a monitor answered nothing for over 40 s)
JOIN_PATIENCE_S = 120.0
SLOW_DIAL_S = 5.0  # a libp2p dial refused or reset fails within about a second; a busy peer's takes longer
P2PD_GOGC = "25"  # the libp2p daemon's Go collector runs when its heap has grown by a quarter


def lean_p2pd() -> None:
    """Make the libp2p daemons this process starts (hivemind passes them its environment) collect their
    garbage when their heap has grown by 25% (``GOGC=25``) instead of doubled (Go's default): about 25 MB less
    memory per peer (docs/benchmarks.md). A user's ``GOGC`` or ``GOMEMLIMIT`` is kept."""
    if "GOGC" not in os.environ and "GOMEMLIMIT" not in os.environ:
        os.environ["GOGC"] = P2PD_GOGC


def create_dht(
    *,
    initial_peers: list[str] = (),
    host_maddrs: list[str] = ("/ip4/0.0.0.0/tcp/0",),
    announce_maddrs: list[str] = (),
    identity_path: str = "",
    client_mode: bool = False,
    use_google_dns: bool = False,
    use_ipfs: bool = False,
    nat_port_map: bool = False,
    use_relay: bool = True,
    use_auto_relay: bool = False,
    startup_timeout: float = 20.0,
    record_validators: list = (),
    wait_timeout: float = 10.0,
    access=None,
    in_thread: bool = True,
) -> hivemind.DHT:
    """Start this process's DHT node; raise UserError with one line when the swarm cannot be reached.

    ``access`` (cotrain's AccessControl) makes it a peer of a private swarm: its requests carry its token and
    it refuses those without a valid one. ``in_thread``: the node, and the averagers that use it, serve from
    threads of this process, not processes of their own (cotrain.hivemind_ext.hosting)."""
    lean_p2pd()
    initial_peers = parse_maddrs(list(initial_peers), "initial peer")
    host_maddrs = parse_maddrs(list(host_maddrs), "listen")
    announce_maddrs = parse_maddrs(list(announce_maddrs), "announce")
    if use_google_dns:
        announce_maddrs += announce_public_address(host_maddrs)
    record_validators = list(record_validators)
    identity: dict = {}
    if identity_path:
        peer_id = ensure_identity(identity_path)
        check_identity_free(identity_path, peer_id, initial_peers, startup_timeout)
        # checked above; hivemind's own check would start a node with router port mapping on
        identity = {
            "identity_path": str(Path(identity_path).expanduser()),
            "check_if_identity_free": False,
        }
    private: dict = {}
    if access is not None:
        # the revocation list in the DHT is guarded; requests carry this peer's token
        record_validators.append(RevocationsValidator(access.revocations_key, access.authority_public_key))
        private = {"access": access, "authorizer": SwarmAuthorizer(access)}

    share_by_descriptors()  # before the DHT's process, the averagers' and their tensors
    options = dict(
        **private,
        initial_peers=initial_peers,
        client_mode=client_mode,
        record_validators=record_validators,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs or None,
        **identity,
        use_ipfs=use_ipfs,
        nat_port_map=nat_port_map,
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
        startup_timeout=startup_timeout,
        wait_timeout=wait_timeout,
        in_thread=in_thread,
        start=True,
    )
    first = time.monotonic()
    for attempt in itertools.count(2):
        started = time.monotonic()
        try:
            dht = SwarmDHT(**options)
            break
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            took = time.monotonic() - started
            # the initial peers were there but answered too late: a busy machine or a saturated link, not a
            # wrong address (a refused connection fails at once). Either their DHT answered no ping within
            # wait_timeout, or already their daemon did not finish the connection's handshake in time (the
            # daemon's own dial timeout), before the DHT could ping them.
            slow = ("responded to a ping" in text and took >= wait_timeout) or (
                "failed to connect to bootstrap peers" in text and took >= SLOW_DIAL_S
            )
            waited = time.monotonic() - first
            if initial_peers and slow and waited < JOIN_PATIENCE_S:
                logger.warning(
                    f"No initial peer answered in time (a busy machine or a slow link?); trying again (try "
                    f"{attempt}, {waited:.0f} s of at most {JOIN_PATIENCE_S:.0f})"
                )
                continue
            raise _start_error(text, initial_peers, host_maddrs, access) from None
    if access is not None:
        dht.run_coroutine(start_access_service)
    return dht


def _start_error(text: str, initial_peers: list[str], host_maddrs: list[str], access) -> UserError:
    """The one line a user sees when the DHT node did not start (``text``: the first line of why)."""
    if initial_peers and ("bootstrap" in text or "initial" in text or "connect" in text):
        reason = probe_refusal(initial_peers, access)  # a private swarm says why it refused this peer
        if reason is not None:
            return UserError(refused_message(reason))
        return UserError(
            f"no initial peer could be reached ({', '.join(initial_peers)}): check the addresses and that "
            "the swarm is running"
        )
    if "address already in use" in text.lower():
        return UserError(f"cannot listen on {', '.join(host_maddrs)}: address already in use")
    return UserError(f"the network layer failed to start: {text}")


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
