"""The monitor: the swarm's first peer. Welcomes others onto the DHT and aggregates the trainers' metrics."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from cotrain.config import Config
from cotrain.swarm.dht import create_dht, visible_maddrs
from cotrain.swarm.records import LocalMetrics, make_validators, read_metrics

logger = logging.getLogger(__name__)


def aggregate(step: int, records: dict[bytes, LocalMetrics]) -> dict:
    """One line of the swarm's metrics for a global step, as the seed recipe computes it."""
    values = list(records.values())
    mini_steps = sum(r.mini_steps for r in values)
    current = [r for r in values if r.step == step]
    return {
        "step": step,
        "loss": sum(r.loss for r in values) / mini_steps if mini_steps else None,
        "alive_peers": len(values),
        "samples": sum(r.samples_accumulated for r in values),
        "samples_per_second": sum(r.samples_per_second for r in values),
        "max_group_size": max((r.group_size for r in current), default=1),
        "client_peers": sum(r.client_mode for r in values),
        "time": time.time(),
    }


def join_command(maddrs: list[str], run_id: str) -> str:
    peers = " ".join(maddrs)
    return f"cotrain train --run-id {run_id} --initial-peers {peers} --dataset-path DATA"


class Monitor:
    def __init__(self, config: Config, stop: threading.Event):
        self.config = config
        self.stop = stop
        self.dht = None

    def run(self) -> int:
        run, peer = self.config.run, self.config.peer
        out = Path(peer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        validators, _ = make_validators(run.run_id)
        self.dht = create_dht(peer, validators, client_mode=False)
        maddrs = visible_maddrs(self.dht)
        (out / "initial_peers.txt").write_text("\n".join(maddrs) + "\n")
        logger.info(
            f"Monitor of run {run.run_id!r} is up. To join, run:\n  {join_command(maddrs, run.run_id)}"
        )

        current_step = -1
        with open(out / "metrics.jsonl", "a", buffering=1) as sink:
            while not self.stop.wait(peer.refresh_period):
                try:
                    records = read_metrics(self.dht, run.run_id)
                except Exception as e:  # network trouble degrades, it never kills the monitor
                    logger.warning(f"Reading metrics from the DHT failed: {e!r}")
                    continue
                if not records:
                    continue
                latest = max(r.step for r in records.values())
                if latest == current_step:
                    continue
                current_step = latest
                line = aggregate(latest, records)
                sink.write(json.dumps(line) + "\n")
                logger.info(
                    f"step {latest} | loss {line['loss'] or float('nan'):.5f} | "
                    f"{line['alive_peers']} peers | "
                    f"{line['samples']} samples | {line['samples_per_second']:.1f} samples/s"
                )
        return 0

    def close(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
