"""How a peer reaches the swarm: its addresses and identity, admission to a private swarm, client mode,
relays, IPFS and NAT traversal."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import not_positive, opt


@dataclass
class NetworkConfig:
    """Network: where this peer listens and announces itself, who it is, how it gets in."""

    TITLE: ClassVar[str] = "network"

    initial_peers: list = opt(
        [],
        "Multiaddrs of peers already in the swarm (a monitor or any trainer); several for redundancy.",
        roles=("train", "monitor", "status", "eval"),
        seed="--initial_peers",
    )
    host_maddrs: list = opt(
        ["/ip4/0.0.0.0/tcp/0"],
        "Multiaddrs to listen on (default: all interfaces, a free port); the old IP:PORT forms "
        "([::]:1337, 0.0.0.0:*) are translated.",
        flags=("--listen-on", "--dht-listen-on"),
        roles=("train", "monitor", "status", "eval"),
        seed=("--host_maddrs", "--listen_on", "--dht_listen_on"),
    )
    announce_maddrs: list = opt(
        [],
        "Multiaddrs other peers should use to reach this one (e.g. a public IP or /dns4/ name).",
        roles=("train", "monitor", "eval"),
        seed="--announce_maddrs",
    )
    identity_path: str = opt(
        "",
        "File holding this peer's private key (created, owner-only, when missing): the same file gives the "
        "same peer id across restarts.",
        roles=("train", "monitor", "eval"),
        seed="--identity_path",
    )
    access_token: str = opt(
        "",
        "Token file from the operator of a private swarm (`cotrain token issue`); without one, only public "
        "swarms can be joined.",
        roles=("train", "status", "eval"),
    )
    authority_key: str = opt(
        "",
        "Authority key of a private swarm (made by `cotrain token issue`): admit only peers whose access "
        "tokens it signed and that are not revoked.",
        roles=("monitor",),
    )
    client_mode: bool = opt(
        False,
        "Do not accept incoming connections (behind NAT/firewall): train and average through other peers.",
        roles=("train",),
        seed="--client_mode",
    )
    public: bool = opt(
        False,
        "This peer can be dialed by others (a public IP, or a port forwarded to it): join as a full peer "
        "without the reachability probe. Without it (and without --client-mode) a peer asks an initial peer "
        "to dial it back first, and joins as a client when it cannot.",
        roles=("train", "monitor"),
    )
    use_ipfs: bool = opt(
        False, "Bootstrap through the public IPFS network.", roles=("train", "monitor"), seed="--use_ipfs"
    )
    nat_port_map: bool = opt(
        False,
        "Ask the router for a port mapping (UPnP/NAT-PMP); off unless asked.",
        roles=("train", "monitor"),
    )
    use_relay: bool = opt(
        True,
        "Let libp2p circuit relays carry connections to and from peers behind NAT (--no-use-relay: never).",
        roles=("train", "monitor", "eval"),
    )
    use_auto_relay: bool = opt(
        False,
        "Behind NAT: ask libp2p for relays among the swarm's public peers to become reachable through them "
        "(not reached in cotrain's NAT benchmark: behind NAT prefer --client-mode).",
        roles=("train", "monitor", "eval"),
    )
    use_google_dns: bool = opt(
        False,
        "Announce the address this machine reaches the internet from (a UDP socket 'connected' to 8.8.8.8 "
        "names it without sending a packet): the public IP of a server or cloud VM.",
        roles=("train", "monitor"),
        seed="--use_google_dns",
    )
    swarm_processes: bool = opt(
        False,
        "Run the DHT and the averagers as processes of their own, forked from this peer's (hivemind's way), "
        "instead of threads of it: about 170 MB more per trainer, their Python work beside the training "
        "thread's rather than sharing its interpreter.",
        roles=("train", "monitor", "eval"),
    )
    startup_timeout: float = opt(
        20.0,
        "Seconds to wait for the network layer to start and reach initial peers.",
        roles=("train", "monitor", "status", "eval"),
    )

    def problems(self) -> list[str]:
        problems = not_positive(self, "startup_timeout")
        if self.client_mode and self.public:
            problems.append(
                "--client-mode and --public contradict each other (a client accepts no connections): "
                "choose one, or neither to let the peer find out"
            )
        return problems
