"""`cotrain status`: join the DHT as a client, read the swarm's records once, describe them, leave.

It runs in the CLI's own process (it is short-lived); hivemind's DHT process and p2pd daemon are its
children and are shut down, then killed if anything is left, before it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from cotrain.config import Config, PeerConfig, RunConfig
from cotrain.engine.join import SwarmConnection, take_swarm_run
from cotrain.errors import UserError
from cotrain.net.configrecord import API_ROLE
from cotrain.registry import DEFAULT_STRATEGY, strategy_class
from cotrain.snapshot import read_snapshot

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"  # a client accepts no connections: listening on loopback is enough
STRATEGY_WAIT = 3.0  # seconds to wait for the swarm's config record when the user gave run settings


def swarm_status(config: Config, attempts: int = 3) -> dict:
    """The swarm's state as one dict (see cotrain.snapshot.snapshot)."""

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
        if config.run_given:
            run = _swarm_strategy(connection, run, config.run_given)
        state: dict = {}
        for attempt in range(attempts):  # right after joining, the routing table may still be filling
            state = read_snapshot(
                connection.dht, run.run_id, run.target_batch_size, run.strategy, run.local_steps
            )
            if state["num_peers"] or not _trainers_published(connection):  # a swarm of no trainer yet: 0
                break
            time.sleep(0.5 * (attempt + 1))
        state.update(strategy_class(run.strategy).settings_shown(run))  # e.g. the rounds' compression
        return state
    finally:
        try:
            connection.close()
        finally:
            _reap_children()


def _trainers_published(connection: SwarmConnection) -> bool:
    """Whether a peer that trains (a trainer, a loop of one's own) publishes its config record in the run:
    then its progress is on the way, and worth another read."""
    return any(connection.peers_in_role(role) for role in ("trainer", API_ROLE))


def _swarm_strategy(connection: Any, run: RunConfig, given: list[str]) -> RunConfig:
    """``run`` with the swarm's strategy and local steps (from its config record) where the user named none:
    a status given a --preset still shows a diloco swarm's rounds."""

    found = connection.swarm_run(wait=STRATEGY_WAIT)
    if found is None:
        return run
    fields = found[0]
    names = ("strategy", "local_steps", "outer_compression")
    names += ("topk_density", "topk_bits", "topk_feedback_decay")
    taken = {k: fields[k] for k in names if k not in given and k in fields}
    try:
        return dataclasses.replace(run, **taken)
    except TypeError:
        return run


def _reap_children() -> None:
    """Kill whatever this process started and is still running (hivemind's daemon outlives a failed start)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


# the headings of a strategy's per-peer fields (Strategy.peer_fields) in the table of peers
COLUMNS = {"inner_steps": "inner", "round_bytes": "sent/round"}


def _width(name: str) -> int:
    return 12 if name.endswith("_bytes") else 8


def megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def describe(state: dict) -> str:
    """Human-readable lines for a terminal. With diloco, a global step is an outer round: the lines also show
    the inner steps, the samples per round and the bytes sent in the last round."""
    eta = state.get("eta_seconds")
    strategy = state.get("strategy", DEFAULT_STRATEGY)
    kind = strategy_class(strategy)
    target = state.get("step_samples") or state["target_batch_size"]
    pct = 100 * state["samples_accumulated"] / target if target else 0.0
    lines = [f"run {state['run_id']}: {kind.step_name} {state['global_step']} (strategy {strategy})"]
    lines += kind.status_lines(state)
    lines += [
        f"peers: {state['num_peers']} ({state['num_clients']} in client mode"
        + (f"; {state['departed_peers']} left recently)" if state.get("departed_peers") else ")"),
        f"next {kind.step_name.split()[-1]}: {state['samples_accumulated']} of {target} samples "
        f"({pct:.0f}%), "
        f"{state['samples_per_second']:.1f} samples/s, ETA {'unknown' if eta is None else f'{eta:.0f} s'}",
    ]
    if state["peers"]:
        extra = "".join(f"{COLUMNS.get(name, name):>{_width(name)}}" for name in kind.peer_fields)
        head = f"{'peer':<14}{'reach':<8}{'step':>6}{'samples/s':>12}{'contribution':>14}{'last seen':>12}"
        lines.append(head + extra)
        for p in state["peers"]:
            line = (
                f"{p['short_id']:<14}{'client' if p.get('client_mode') else 'public':<8}{p['step']:>6}"
                f"{p.get('samples_per_second', 0.0):>12.1f}{p['contribution']:>14}{p['seconds_ago']:>10.0f} s"
            )
            for name in kind.peer_fields:
                value = p.get(name, 0)
                line += f"{megabytes(value) if name.endswith('_bytes') else value:>{_width(name)}}"
            lines.append(line)
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
