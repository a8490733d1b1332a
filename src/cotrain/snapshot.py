"""The swarm's state as the DHT holds it: cotrain's metrics records plus hivemind's progress records.

hivemind's ``ProgressTracker`` keeps one ``LocalTrainingProgress`` per peer under ``{run_id}_progress``
(epoch, samples accumulated in it, samples/s, time, client mode); cotrain's trainers add a metrics record per
global step under ``{run_id}_metrics``. Both are keyed by the peer's public key, so they join on it. The
monitor's dashboard and ``cotrain status`` show the same snapshot.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hivemind.p2p import PeerID

from cotrain.hivemind_ext.unexported import LocalTrainingProgress
from cotrain.keys import progress_key
from cotrain.net.metrics import EvalMetrics, LocalMetrics, read_evaluations, read_metrics, read_records
from cotrain.registry import DEFAULT_STRATEGY, strategy_class

logger = logging.getLogger(__name__)


def read_progress(dht: Any, run_id: str) -> dict[bytes, Any]:
    """Every peer's latest hivemind ``LocalTrainingProgress`` (malformed entries dropped)."""
    return read_records(dht, progress_key(run_id), LocalTrainingProgress, "progress")


def _peer_name(raw: bytes) -> str:
    try:
        return PeerID(raw).to_base58()
    except Exception:
        return raw.hex()


def short_id(peer_id: str) -> str:
    """The tail of a peer id: libp2p ids share their prefix (``12D3KooW...``)."""
    return f"...{peer_id[-8:]}" if len(peer_id) > 12 else peer_id


def step_samples(target_batch_size: int, strategy: str = DEFAULT_STRATEGY, local_steps: int = 1) -> int:
    """Samples the swarm accumulates per global step (the strategy's: with diloco an outer round of
    local_steps times target_batch_size)."""
    return strategy_class(strategy).samples_per_step(target_batch_size, local_steps)


def snapshot(
    run_id: str,
    target_batch_size: int,
    metrics: dict[bytes, LocalMetrics],
    progress: dict[bytes, Any],
    now: float | None = None,
    strategy: str = DEFAULT_STRATEGY,
    local_steps: int = 1,
) -> dict:
    """A JSON-ready view: the global step, every alive peer, the samples accumulated toward the next step and
    its ETA (estimated as hivemind's tracker does: accumulated + elapsed x rate, over the swarm's rate).
    ``strategy`` and ``local_steps`` are the run's: with diloco the next step is the next outer round
    (``step_samples``), and the view adds the inner steps and the bytes sent per round.

    A peer is alive while its progress record is: hivemind refreshes it every half ``metadata_expiration``
    while the peer trains and clears it when the peer stops, and the DHT drops it once expired. A metrics
    record outlives its peer (it is published once per global step and kept ``statistics_expiration``, 600 s
    by default): a peer with only a metrics record has left (or fell behind and is catching up), so it is
    counted under ``departed_peers`` and neither as a peer nor in the throughput."""
    now = time.time() if now is None else now
    kind = strategy_class(strategy)
    fields = kind.peer_fields
    departed = [m for key, m in metrics.items() if key not in progress]
    metrics = {key: m for key, m in metrics.items() if key in progress}
    peers: dict[bytes, dict] = {}
    for key, m in metrics.items():
        peers[key] = {
            "peer_id": m.peer_id,
            "client_mode": m.client_mode,
            "samples_per_second": m.samples_per_second,
            "contribution": m.samples_accumulated,
            "step": m.step,
            "last_seen": m.time,
        }
        peers[key].update({name: getattr(m, name) for name in fields})
    for key, p in progress.items():
        row = peers.setdefault(key, {"contribution": 0, "step": p.epoch, "last_seen": 0.0})
        row["peer_id"] = row.get("peer_id") or _peer_name(p.peer_id)
        row["client_mode"] = p.client_mode
        row["samples_per_second"] = p.samples_per_second
        row["step"] = max(row["step"], p.epoch)
        row["last_seen"] = max(row["last_seen"], p.time)
    servers = [p.epoch for p in progress.values() if not p.client_mode]
    step = max(servers or [p.epoch for p in progress.values()] or [m.step for m in departed] or [0])
    current = [p for p in progress.values() if p.epoch == step]
    accumulated = sum(p.samples_accumulated for p in current)
    estimated = sum(p.samples_accumulated + max(0.0, now - p.time) * p.samples_per_second for p in current)
    throughput = sum(row.get("samples_per_second", 0.0) for row in peers.values())
    per_step = kind.samples_per_step(target_batch_size, local_steps)
    eta = max(0.0, per_step - estimated) / throughput if throughput > 0 else None
    rows = []
    for row in peers.values():
        rows.append(
            {
                **row,
                "short_id": short_id(row.get("peer_id", "")),
                "seconds_ago": round(max(0.0, now - row["last_seen"]), 1),
            }
        )
    rows.sort(key=lambda r: r.get("peer_id", ""))
    state = {
        "run_id": run_id,
        "strategy": strategy,
        "global_step": step,
        "peers": rows,
        "num_peers": len(rows),
        "num_clients": sum(bool(r.get("client_mode")) for r in rows),
        "departed_peers": len(departed),
        "samples_accumulated": accumulated,
        "target_batch_size": target_batch_size,
        "step_samples": per_step,
        "samples_per_second": throughput,
        "eta_seconds": None if eta is None else round(eta, 1),
        "time": now,
    }
    swarm = kind.swarm_fields(list(metrics.values()))  # e.g. diloco's inner steps and bytes per round
    if swarm:
        state.update(local_steps=local_steps, **swarm)
    return state


def evaluation_rows(evaluations: dict[bytes, EvalMetrics]) -> list[dict]:
    """Each evaluation peer's latest result, newest step first (what ``cotrain status`` shows of them)."""
    rows = []
    for record in evaluations.values():
        row = {"peer_id": record.peer_id, "short_id": short_id(record.peer_id)}
        for name in ("step", "loss", "perplexity", "lm_loss", "mlm_accuracy", "sop_accuracy", "examples"):
            row[name] = getattr(record, name)
        row["time"] = record.time
        rows.append(row)
    rows.sort(key=lambda r: (-r["step"], -r["time"]))
    return rows


def read_snapshot(
    dht: Any, run_id: str, target_batch_size: int, strategy: str = DEFAULT_STRATEGY, local_steps: int = 1
) -> dict:
    """The snapshot, with the latest result of every evaluation peer under ``evaluations``."""
    metrics, progress = read_metrics(dht, run_id), read_progress(dht, run_id)
    state = snapshot(run_id, target_batch_size, metrics, progress, strategy=strategy, local_steps=local_steps)
    state["evaluations"] = evaluation_rows(read_evaluations(dht, run_id))
    return state
