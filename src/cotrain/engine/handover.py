"""The swarm's state handed between peers: a newcomer catches up on joining, a peer done training leaves its
final state to the monitor's checkpoint before it goes (both for ``SwarmPeer``, cotrain.engine.peer)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from cotrain.config import PeerConfig, RunConfig
from cotrain.net.served import served_epochs


class Joined(Protocol):
    """What the handover reads of a peer that joined (cotrain.engine.peer.SwarmPeer)."""

    strategy: Any
    connection: Any
    run: RunConfig
    peer_config: PeerConfig
    events: Callable[[str, dict], None]

    @property
    def dht(self) -> Any: ...

    @property
    def global_step(self) -> int: ...


logger = logging.getLogger(__name__)

CATCH_UP_WAIT = 5.0  # seconds a newcomer waits to see other peers before deciding it is the first
POLL = 0.5  # seconds between looks at the DHT while waiting


def newest_served(peer: Joined) -> int:
    """The newest step that another peer (a trainer, or a monitor with no trainer left) declares it serves."""
    me = peer.dht.peer_id.to_bytes()
    return int(max((e for p, e in served_epochs(peer.dht, peer.run.run_id).items() if p != me), default=0))


def catch_up(peer: Joined, stop: threading.Event) -> int:
    """Load the swarm's state when others are already further along (bounded, with a message).

    A peer given initial peers waits up to ``CATCH_UP_WAIT`` seconds to see either another trainer's progress
    or a state served (a resumed monitor serves its checkpoint before any trainer is back) before it decides
    that it starts the run. Returns the global step it starts from."""
    strategy = peer.strategy
    deadline = time.monotonic() + min(CATCH_UP_WAIT, peer.peer_config.load_state_timeout)
    served = newest_served(peer)
    if peer.peer_config.initial_peers:  # the first peer has nobody to wait for
        while (
            strategy.progress.num_peers <= 1
            and not served
            and time.monotonic() < deadline
            and not stop.is_set()
        ):
            time.sleep(POLL)
            served = newest_served(peer)
    swarm_step = max(strategy.progress.swarm_step, served or newest_served(peer))
    loaded = False
    if swarm_step > peer.global_step:
        logger.info(
            f"The swarm is at step {swarm_step} ({strategy.progress.num_peers} peers): loading its current "
            f"state (waiting up to {peer.peer_config.load_state_timeout:.0f} s)"
        )
        before = peer.global_step
        strategy.load_state_from_peers()
        loaded = peer.global_step > before
        logger.info(f"Starting from global step {peer.global_step}")
    peer.events("started", {"step": peer.global_step, "swarm_step": swarm_step, "loaded": loaded})
    return peer.global_step


def leave_final_state(peer: Joined, stop: threading.Event, timeout: float | None = None) -> bool:
    """Announce that ``peer`` is leaving (a monitor then fetches the newest state at once) and keep serving
    its state until a monitor serves one at least as new, for up to ``timeout`` seconds (default:
    load_state_timeout + 30). Returns whether a monitor has it; False at once when no monitor keeps
    checkpoints. A monitor that keeps them says so in its config record, whether or not it serves a state yet
    (before its first checkpoint it serves none, and it takes this one whatever its --save-every)."""
    monitors = peer.connection.peers_in_role("monitor", keeps_state=True)
    run_id = peer.run.run_id
    if not monitors:  # nobody to wait for
        logger.info("No monitor keeps this run's checkpoints: leaving without handing over the final state")
        return False
    step = peer.global_step
    timeout = peer.peer_config.load_state_timeout + 30 if timeout is None else timeout

    def has_it() -> bool:
        return any(served_epochs(peer.dht, run_id).get(p, -1) >= step for p in monitors)

    if has_it():
        peer.events("leaving", {"step": step, "monitor_has_it": True})
        return True
    peer.connection.announce_leaving()
    logger.info(
        f"Leaving the final state (global step {step}) to the monitor's checkpoint "
        f"(waiting up to {timeout:.0f} s)"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.wait(1.0):
        if has_it():
            logger.info(f"The monitor holds global step {step}")
            peer.events("leaving", {"step": step, "monitor_has_it": True})
            return True
    logger.warning(f"No monitor took global step {step} within {timeout:.0f} s")
    peer.events("leaving", {"step": step, "monitor_has_it": False})
    return False
