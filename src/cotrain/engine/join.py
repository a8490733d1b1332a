"""Joining a swarm: the one sequence every role (trainer, monitor, evaluation peer, API peer, ``cotrain
status``) goes through before it does anything else.

record validators -> access control (private swarms) -> the DHT node -> a watcher of this peer's access
-> the swarm's run config: taken as it is (a peer that named no run settings: from the first initial peer that
answers, the address the user vouched for; only when none answers, from the DHT's records) or checked against
this peer's own (a differing one is refused, naming the fields), then published, signed, and served to
newcomers for as long as the peer runs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID

from cotrain.access.control import access_for
from cotrain.access.voters import Voters, voters_of
from cotrain.config import ConfigError, PeerConfig, RunConfig, load_preset, write_toml
from cotrain.errors import UserError
from cotrain.net.configrecord import (
    API_ROLE,
    ConfigPublisher,
    join_check,
    make_record,
    projected,
    read_configs,
    swarm_record,
)
from cotrain.net.dht import create_dht, parse_maddrs, visible_maddrs
from cotrain.net.metrics import make_validators
from cotrain.net.probe import AccessWatcher
from cotrain.net.reachability import ASK_TIMEOUT, NOT_REACHED, dial_back, serve_dial_back
from cotrain.net.vouch import ask_initial_peers, serve_config

logger = logging.getLogger(__name__)

CONFIG_WAIT = 5.0  # seconds a peer that named no run settings waits to read the swarm's config record


class SwarmConnection:
    """A joined swarm: this process's DHT node, its signing key, its access control and config publisher."""

    def __init__(
        self,
        run_id: str,
        peer: PeerConfig,
        *,
        role: str,
        client_mode: bool | None = None,
        stop: threading.Event | None = None,
    ) -> None:

        self.run_id, self.peer, self.role = run_id, peer, role
        self.stop = stop or threading.Event()
        self.publisher: Any = None
        self.watcher: Any = None
        validators, self.public_key = make_validators(run_id)
        self.access = _access(run_id, peer, role)
        client_mode = peer.client_mode if client_mode is None else client_mode
        self.reachability = None
        if not client_mode and role in PROBED and peer.initial_peers and not peer.public:
            self.reachability = _probe(peer, role, self.access)
            # a monitor stays a full peer (it serves the run's settings and state): _probe warned or refused;
            # a peer that every answering peer called busy joins as a client (the safe side)
            unsure = self.reachability.reached is None and self.reachability.busy
            client_mode = (self.reachability.reached is False or unsure) and role != "monitor"
        reach = _reach(peer, role, client_mode, self.reachability)
        self.dht = create_dht(
            initial_peers=peer.initial_peers,
            host_maddrs=peer.host_maddrs,
            announce_maddrs=peer.announce_maddrs,
            identity_path=peer.identity_path,
            client_mode=client_mode,
            use_google_dns=peer.use_google_dns,
            use_ipfs=peer.use_ipfs,
            nat_port_map=peer.nat_port_map,
            use_relay=peer.use_relay,
            use_auto_relay=peer.use_auto_relay,
            startup_timeout=peer.startup_timeout,
            in_thread=not peer.swarm_processes,
            record_validators=validators,
            access=self.access,
        )
        if reach:
            logger.info(f"Reach: {reach}")
        if self.access is not None:  # its records count as one participant's votes (cotrain.access.voters)
            Voters.of(self.dht)
        if not client_mode:  # newcomers ask it to dial them back
            serve_dial_back(self.dht)
        if self.access is not None and role != "monitor":  # a token holder stops when it is refused
            self.watcher = AccessWatcher(self.dht, peer.initial_peers, self.stop)
            self.watcher.start()

    @property
    def client_mode(self) -> bool:
        return bool(self.dht.client_mode)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    def maddrs(self) -> list[str]:

        return visible_maddrs(self.dht)

    @property
    def refusal(self) -> str | None:
        """Why the swarm refused this peer's access token while it ran (a private swarm), if it did."""
        return self.watcher.refusal if self.watcher is not None else None

    # --- the run's config -------------------------------------------------------------------------

    def swarm_run(self, wait: float = CONFIG_WAIT) -> tuple[dict, int] | None:
        """The run config most of the swarm's peers publish and how many publish it (None: no record seen
        within ``wait`` seconds)."""

        deadline = time.monotonic() + wait
        while True:
            records = {k: r for k, r in read_configs(self.dht, self.run_id).items() if k != self.public_key}
            found = swarm_record(records, voters_of(self.dht))
            if found is not None:
                return found[0].fields(), found[1]
            if time.monotonic() >= deadline or self.stop.is_set():
                return None
            time.sleep(0.5)

    def agree(
        self,
        run: RunConfig,
        tokenizer_hash: str = "",
        publish: bool = True,
        manifest_sha256: str = "",
        names: tuple[str, ...] | None = None,
    ) -> None:
        """Refuse this peer when its run config differs from the swarm's (ConfigMismatch names the fields);
        with ``publish``, keep publishing it, signed, while the peer runs (with the sha256 of the dataset
        manifest it has, for newcomers to check theirs against). With ``names`` (a loop of one's own: the
        settings it takes), only those are compared and published."""

        fields = projected(dataclasses.asdict(run), names)
        mine = make_record(fields, self.role, tokenizer_hash, self.peer_id, manifest_sha256=manifest_sha256)
        self.initial_peer_record()  # asked once: the address's settings, and the key that signs its records
        join_check(self.dht, self.run_id, mine, self.public_key, self.peer.initial_peers, names)
        if publish:
            self.publisher = ConfigPublisher(self.dht, self.run_id, self.public_key, mine)
            self.publisher.start()
            self._serve_config()

    def _serve_config(self) -> None:
        """Answer newcomers' config requests with this peer's record (cotrain.net.vouch)."""

        try:
            serve_config(self.dht, self.run_id, self.publisher.record, self.public_key)
        except Exception as e:  # newcomers then read the DHT's records, as from a peer of an older version
            logger.warning(f"Serving this peer's config to newcomers failed: {e!r}")

    def initial_peer_record(self) -> tuple[str, Any] | None:
        """The config record (cotrain.net.configrecord.ConfigRecord) of the first initial peer (``/p2p/ID``
        of --initial-peers, in order) that answers, with its peer id; None when none answers. Asked once."""

        if not hasattr(self, "_vouched"):
            found = ask_initial_peers(self.dht, self.run_id, self.peer.initial_peers)
            self._vouched = None if found is None else found[:2]
            if found is not None and found[2]:  # the state check weighs the address's own records most
                self.dht.anchor_signers = frozenset([found[2]])
        return self._vouched

    def initial_peer_run(self) -> tuple[str, dict] | None:
        """The run config that the first answering initial peer vouches for, with its peer id; None when none
        answers."""
        found = self.initial_peer_record()
        if found is None or found[1].role == API_ROLE:  # a loop of one's own publishes no whole run config
            return None
        return found[0], found[1].fields()

    def peers_in_role(self, role: str, keeps_state: bool | None = None) -> dict[bytes, str]:
        """The peers whose config record names ``role`` (e.g. "monitor", "leaving"), with ``keeps_state``
        those whose record says whether they keep the swarm's checkpoints: raw peer id -> base58."""

        out = {}
        for record in read_configs(self.dht, self.run_id).values():
            if keeps_state is not None and record.keeps_state != keeps_state:
                continue
            if record.role == role and record.peer_id and record.peer_id != self.peer_id:
                try:
                    out[PeerID.from_base58(record.peer_id).to_bytes()] = record.peer_id
                except Exception:  # not a peer id after all: ignored like any malformed record
                    continue
        return out

    def announce_leaving(self) -> None:
        """Tell the swarm (the monitor) that this peer is done training and leaves soon."""
        if self.publisher is not None:
            self.publisher.announce(role="leaving")
            self._serve_config()

    def announce_keeping_state(self) -> None:
        """Tell the swarm that this peer (a monitor) checkpoints its state: trainers that are done training
        leave their final state to it."""
        if self.publisher is not None:
            self.publisher.announce(keeps_state=True)
            self._serve_config()

    def close(self) -> None:
        """Stop publishing and leave the DHT."""
        if self.publisher is not None:
            self.publisher.close()
        voters = getattr(self.dht, "cotrain_voters", None)
        if voters is not None:
            voters.close()
        if self.dht is not None:
            try:
                self.dht.shutdown()
            except Exception as e:
                logger.debug(f"DHT shutdown: {e!r}")
            self.dht = None


PROBED = ("trainer", "api", "monitor")  # roles that find out whether others can dial them before joining


def _probe(peer: PeerConfig, role: str, access: Any = None) -> Any:
    """Ask an initial peer to dial this one back (cotrain.net.reachability) and say in one line what was
    found and what this peer does about it. A monitor that cannot be dialed cannot reduce for others: a
    UserError unless --no-reduce."""

    # checked as the DHT checks them (a malformed address is one line, before anything starts)
    initial = parse_maddrs(list(peer.initial_peers), "initial peer")
    hosts = parse_maddrs(list(peer.host_maddrs), "listen")
    found = dial_back(initial, hosts, parse_maddrs(list(peer.announce_maddrs), "announce"), access=access)
    where = ", ".join(found.addresses) or "its addresses"
    if found.reached is None and not found.connected:  # the DHT's join says why, in one line
        logger.debug("No initial peer could be connected to for the reachability probe")
    elif found.reached is None and found.busy and role != "monitor":
        logger.info(
            f"The initial peers were too busy to answer the reachability probe within {ASK_TIMEOUT:.0f} s: "
            "joining as a client (--public if others can dial this peer)"
        )
    elif found.reached is None:
        logger.info(
            f"No initial peer answered the reachability probe within {ASK_TIMEOUT:.0f} s: assuming others "
            "can dial this peer (--client-mode if they cannot)"
        )
    elif (
        found.reached
    ):  # said once the DHT is up (SwarmConnection): a peer refused at start says its error alone
        pass
    elif role == "monitor" and peer.reduce:
        raise UserError(
            f"other peers cannot dial this monitor (initial peer {found.peer} could not reach it at {where}"
            f"{_why(found.detail)}), so it cannot reduce for them: run it on a public machine, open "
            "a port (--host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT, PORT "
            "forwarded to this machine), or pass --no-reduce"
        )
    elif role == "monitor":
        logger.warning(
            f"Other peers cannot dial this monitor (initial peer {found.peer} could not reach it at "
            f"{where}): newcomers cannot take the run's settings or state from it; run it on a public machine"
        )
    else:
        logger.info(
            f"Other peers cannot dial this peer (initial peer {found.peer} could not reach it at {where}"
            f"{_why(found.detail)}): joining as a client, which sends its parts and receives the "
            "averages through peers that can be dialed. To reduce for others too, forward a port to this "
            "machine (--host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT --public)"
        )
    return found


def _reach(peer: PeerConfig, role: str, client_mode: bool, found: Any) -> str:
    """How a trainer (or a loop of one's own) joining through initial peers is reached, where the probe's own
    lines (a client, busy peers, no answer) did not say it: dialed back, or its flags chose."""
    if role not in PROBED or role == "monitor" or not peer.initial_peers:
        return ""
    if found is not None:
        where = ", ".join(found.addresses) or "its addresses"
        return f"public (initial peer {found.peer} dialed this peer back at {where})" if found.reached else ""
    return "client (--client-mode)" if client_mode else "public (--public: not probed)"


def _why(detail: str) -> str:
    """An answer's detail after a colon, where it says more than that the dial failed."""

    return f": {detail}" if detail and detail != NOT_REACHED else ""


def _access(run_id: str, peer: PeerConfig, role: str) -> Any:
    """A private swarm's access control: the monitor holds the authority key, every other peer a token."""

    if role == "monitor":
        return access_for(run_id, "", peer.authority_key)
    return access_for(run_id, peer.access_token, "")


def take_swarm_run(connection: SwarmConnection, run: RunConfig) -> RunConfig:
    """The run settings of a peer that named none (said in one line): those of the first initial peer that
    answers (its address is what the user vouched for, cotrain.net.vouch); only when none answers, those
    that most of the DHT's signed config records publish (not vouched for: any process can make keys). With
    no record to read either, the peer's own (defaults and preset) stand."""
    vouched = connection.initial_peer_run()
    if vouched is not None:
        peer, fields = vouched
        source = f"initial peer {peer}"
    else:
        found = connection.swarm_run()
        if found is None:
            logger.info(
                f"No config record of run {run.run_id!r} was found: using preset {run.preset} "
                f"(give --preset to choose another)"
            )
            return run
        fields, peers = found
        source = f"the swarm ({peers} peer{'s' if peers != 1 else ''})"
        logger.warning(
            f"No initial peer answered with run {run.run_id!r}'s settings: taking those that most of the "
            f"DHT's config records publish, which no address vouches for (give the run's settings, e.g. "
            f"--preset, to be sure of them)"
        )
    known = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        taken = RunConfig(**{k: v for k, v in fields.items() if k in known})
    except TypeError as e:
        raise UserError(f"the swarm's config record cannot be read by this version of cotrain: {e}") from None
    logger.info(
        f"Taking the settings of run {run.run_id!r} from {source}: "
        f"preset {taken.preset}, {taken.model_family}, target batch {taken.target_batch_size}, "
        f"{taken.optimizer} at learning rate {taken.learning_rate:g}"
    )
    return taken


def take_swarm_settings(connection: SwarmConnection, config: Any) -> bool:
    """A peer whose user named no run settings (``config.run_given`` empty) takes the swarm's run config and
    its preset's per-peer values (micro-batch, ...) wherever the user chose none; the result is validated
    (ConfigError) and written to OUTPUT_DIR/config.toml. Returns whether the swarm's settings were taken."""

    if config.run_given:
        return False
    run = take_swarm_run(connection, config.run)
    if run is config.run:
        return False
    config.peer = with_preset_peer_values(config.peer, config.run.preset, run.preset)
    config.run = run
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    write_toml(config, Path(config.peer.output_dir) / "config.toml")
    return True


def with_preset_peer_values(peer: PeerConfig, old_preset: str, new_preset: str) -> PeerConfig:
    """``peer`` with the per-peer values of ``new_preset`` (its [peer] table: micro-batch, ...) wherever it
    still holds ``old_preset``'s, i.e. wherever the user chose nothing."""

    if old_preset == new_preset:
        return peer
    old, new = load_preset(old_preset).get("peer", {}), load_preset(new_preset).get("peer", {})
    defaults = PeerConfig()
    changes = {}
    for name, value in new.items():
        if hasattr(peer, name) and getattr(peer, name) == old.get(name, getattr(defaults, name)):
            changes[name] = value
    return dataclasses.replace(peer, **changes)
