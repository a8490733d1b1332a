"""The monitor: the swarm's first peer. Welcomes others onto the DHT and aggregates the trainers' metrics."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from cotrain.config import Config
from cotrain.dashboard.view import SwarmView
from cotrain.sinks import SinkSet, build_sinks
from cotrain.swarm.dht import create_dht, visible_maddrs
from cotrain.swarm.records import LocalMetrics, make_validators, read_metrics
from cotrain.swarm.state import read_progress, snapshot

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


DASHBOARD_TICK = 2.0  # seconds between reads of the swarm while a dashboard is open


class Monitor:
    def __init__(self, config: Config, stop: threading.Event):
        self.config = config
        self.stop = stop
        self.dht = None
        self.sinks: SinkSet | None = None
        self.prometheus = None
        self.dashboard = None

    def run(self) -> int:
        run, peer = self.config.run, self.config.peer
        out = Path(peer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        validators, _ = make_validators(run.run_id)
        self.dht = create_dht(peer, validators, client_mode=False)
        maddrs = visible_maddrs(self.dht)
        join = join_command(maddrs, run.run_id)
        self.sinks = build_sinks(out, run.run_id, peer.tensorboard_dir, peer.wandb_project)
        view = SwarmView(run.run_id, join, run.target_batch_size)
        self._start_dashboard(view, out)
        (out / "initial_peers.txt").write_text("\n".join(maddrs) + "\n")  # last: the monitor is ready
        logger.info(f"Monitor of run {run.run_id!r} is up. To join, run:\n  {join}")
        period = min(peer.refresh_period, DASHBOARD_TICK) if self.dashboard else peer.refresh_period

        current_step = -1
        while not self.stop.wait(period):
            try:
                records = read_metrics(self.dht, run.run_id)
                progress = read_progress(self.dht, run.run_id) if self.dashboard else {}
            except Exception as e:  # network trouble degrades, it never kills the monitor
                logger.warning(f"Reading metrics from the DHT failed: {e!r}")
                continue
            state = snapshot(run.run_id, run.target_batch_size, records, progress)
            view.update(state)
            if self.prometheus is not None:
                self.prometheus.write(state["global_step"], state)
            if not records:
                continue
            latest = max(r.step for r in records.values())
            if latest == current_step:
                continue
            current_step = latest
            line = aggregate(latest, records)
            self.sinks.write(latest, line)
            view.add_step(line)
            logger.info(
                f"step {latest} | loss {line['loss'] or float('nan'):.5f} | "
                f"{line['alive_peers']} peers | "
                f"{line['samples']} samples | {line['samples_per_second']:.1f} samples/s"
            )
        return 0

    def _start_dashboard(self, view: SwarmView, out: Path) -> None:
        """Serve the dashboard unless disabled; a missing extra or a busy port is one line, not a failure."""
        peer = self.config.peer
        url_file = out / "dashboard_url.txt"
        url_file.unlink(missing_ok=True)
        if peer.dashboard_port < 0:
            return
        try:
            from cotrain.dashboard.server import DashboardServer
            from cotrain.sinks.prometheus import PrometheusSink

            self.prometheus = PrometheusSink(self.config.run.run_id)
            self.sinks.sinks.append(self.prometheus)
            self.dashboard = DashboardServer(
                view, self.prometheus.text, peer.dashboard_host, peer.dashboard_port
            )
        except ImportError as e:
            logger.info(f"No dashboard ({e.name} is not installed): pip install 'cotrain[dashboard]'")
            return
        except OSError as e:
            logger.warning(
                f"No dashboard: cannot listen on {peer.dashboard_host}:{peer.dashboard_port} ({e.strerror}); "
                f"choose another --dashboard-port (0: any free port)"
            )
            return
        tmp = url_file.with_suffix(".tmp")
        tmp.write_text(self.dashboard.url + "\n")
        tmp.replace(url_file)
        logger.info(f"Dashboard: {self.dashboard.url}")

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
        if self.sinks is not None:
            self.sinks.close()
        if self.dht is not None:
            self.dht.shutdown()
