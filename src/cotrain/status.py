"""`cotrain status`: join the DHT as a client, read the swarm's records once, describe them, leave.

It runs in the CLI's own process (it is short-lived); hivemind's DHT process and p2pd daemon are its
children and are shut down, then killed if anything is left, before it returns.
"""

from __future__ import annotations

import logging
import time

from cotrain.config import Config, PeerConfig
from cotrain.errors import UserError
from cotrain.swarm.state import read_snapshot

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"  # a client accepts no connections: listening on loopback is enough


def swarm_status(config: Config, attempts: int = 3) -> dict:
    """The swarm's state as one dict (see cotrain.swarm.state.snapshot)."""
    import dataclasses

    from cotrain.engine.join import SwarmConnection, take_swarm_run

    peer = config.peer
    if not peer.initial_peers:
        raise UserError(
            "--initial-peers is required: the address of any peer of the swarm (e.g. the monitor)"
        )
    if peer.host_maddrs == PeerConfig().host_maddrs:  # not chosen: a client needs no public listener
        peer = dataclasses.replace(peer, host_maddrs=[LOOPBACK])
    peer = dataclasses.replace(peer, client_mode=True)
    connection = SwarmConnection(config.run.run_id, peer, role="status", client_mode=True)
    try:
        run = config.run if config.run_given else take_swarm_run(connection, config.run)
        state: dict = {}
        for attempt in range(attempts):  # right after joining, the routing table may still be filling
            state = read_snapshot(connection.dht, run.run_id, run.target_batch_size)
            if state["num_peers"]:
                break
            time.sleep(0.5 * (attempt + 1))
        return state
    finally:
        try:
            connection.close()
        finally:
            _reap_children()


def _reap_children() -> None:
    """Kill whatever this process started and is still running (hivemind's daemon outlives a failed start)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def describe(state: dict) -> str:
    """Human-readable lines for a terminal."""
    eta = state.get("eta_seconds")
    target = state["target_batch_size"]
    pct = 100 * state["samples_accumulated"] / target if target else 0.0
    lines = [
        f"run {state['run_id']}: global step {state['global_step']}",
        f"peers: {state['num_peers']} ({state['num_clients']} in client mode"
        + (f"; {state['departed_peers']} left recently)" if state.get("departed_peers") else ")"),
        f"next step: {state['samples_accumulated']} of {target} samples ({pct:.0f}%), "
        f"{state['samples_per_second']:.1f} samples/s, ETA {'unknown' if eta is None else f'{eta:.0f} s'}",
    ]
    if state["peers"]:
        lines.append(
            f"{'peer':<14}{'mode':<8}{'step':>6}{'samples/s':>12}{'contribution':>14}{'last seen':>12}"
        )
        for p in state["peers"]:
            lines.append(
                f"{p['short_id']:<14}{'client' if p.get('client_mode') else 'full':<8}{p['step']:>6}"
                f"{p.get('samples_per_second', 0.0):>12.1f}{p['contribution']:>14}{p['seconds_ago']:>10.0f} s"
            )
    for e in state.get("evaluations", []):  # newest first
        accuracy = "".join(
            f", {label} accuracy {e[name]:.3f}"
            for name, label in (("mlm_accuracy", "masked-token"), ("sop_accuracy", "sentence-order"))
            if e.get(name) is not None
        )
        lines.append(
            f"evaluation by {e['short_id']} at step {e['step']}: held-out loss {e['loss']:.4f}, "
            f"perplexity {e['perplexity']:.2f}{accuracy} ({e['examples']} examples)"
        )
    return "\n".join(lines)
