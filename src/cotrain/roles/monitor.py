"""The monitor: the swarm's first peer. Welcomes others onto the DHT and aggregates the trainers' metrics."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cotrain.config import Config
from cotrain.dashboard.view import SwarmView
from cotrain.sinks import SinkSet, build_sinks
from cotrain.swarm.dht import create_dht, visible_maddrs
from cotrain.swarm.records import LocalMetrics, make_validators, read_metrics
from cotrain.swarm.state import read_progress, snapshot

if TYPE_CHECKING:
    from cotrain.hub import HubUploader
    from cotrain.swarm.keeper import StateKeeper

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
        self.keeper: StateKeeper | None = None
        self.uploader: HubUploader | None = None

    def run(self) -> int:
        run, peer = self.config.run, self.config.peer
        out = Path(peer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "initial_peers.txt").unlink(missing_ok=True)  # a previous run's: written again once ready
        validators, _ = make_validators(run.run_id)
        self.dht = create_dht(peer, validators, client_mode=False)
        maddrs = visible_maddrs(self.dht)
        join = join_command(maddrs, run.run_id)
        self.sinks = build_sinks(out, run.run_id, peer.tensorboard_dir, peer.wandb_project)
        view = SwarmView(run.run_id, join, run.target_batch_size)
        self._start_dashboard(view, out)
        self._start_checkpoints(out)
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
            if self.keeper is not None:
                self.keeper.notice_step(latest)
            line = aggregate(latest, records)
            self.sinks.write(latest, line)
            view.add_step(line)
            logger.info(
                f"step {latest} | loss {line['loss'] or float('nan'):.5f} | "
                f"{line['alive_peers']} peers | "
                f"{line['samples']} samples | {line['samples_per_second']:.1f} samples/s"
            )
        return 0

    def _tokenizer(self, checkpoints: Path) -> Any | None:
        """The run's tokenizer (it gives the model's shapes): --tokenizer-path, the dataset's, or with
        --resume the newest good checkpoint's."""
        from cotrain.data import load_tokenizer, read_manifest

        run, peer = self.config.run, self.config.peer
        if peer.tokenizer_path:
            return load_tokenizer(peer.tokenizer_path, run.objective)
        if peer.dataset_path:
            read_manifest(peer.dataset_path)  # a clear error when it is not a prepared dataset
            return load_tokenizer(Path(peer.dataset_path) / "tokenizer", run.objective)
        if peer.dataset_url:
            from cotrain.data import ExampleStream

            stream = ExampleStream(peer.dataset_url, cache_dir=peer.cache_dir or None, prefetch=-1)
            stream.close()  # only its manifest and tokenizer were needed
            return stream.tokenizer
        if peer.resume:
            from cotrain import checkpoints as ck

            found = ck.latest_good(checkpoints)
            if found is not None:
                return ck.checkpoint_tokenizer(*found)
        return None

    def _start_checkpoints(self, out: Path) -> None:
        """Keep, checkpoint and serve the swarm's state (created here, in the main thread), and upload it."""
        peer = self.config.peer
        root = out / "checkpoints"
        if peer.save_every <= 0 and not peer.resume:
            logger.info("Checkpoints are off (--save-every 0)")
            return
        tokenizer = self._tokenizer(root)
        if tokenizer is None:
            logger.info(
                "Checkpoints are off: the monitor needs the model's shapes; give --dataset-path, "
                "--dataset-url or --tokenizer-path"
            )
            return
        from cotrain.swarm.keeper import StateKeeper

        self.keeper = StateKeeper(self.dht, self.config, tokenizer, root, self.stop)
        if peer.resume:
            self.keeper.resume()
        if peer.save_every > 0:
            self.keeper.start()
            logger.info(f"Checkpoints every {peer.save_every} global steps into {root}")
        if peer.push_to_hub:
            from cotrain.hub import HubUploader

            self.uploader = HubUploader(root, peer.push_to_hub, peer.upload_every, out / "hub", self.stop)
            self.uploader.start()
            logger.info(f"Uploading the newest checkpoint to {peer.push_to_hub} every {peer.upload_every:g}s")

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
        if self.keeper is not None:
            self.keeper.shutdown()
        if self.dashboard is not None:
            self.dashboard.close()
        if self.sinks is not None:
            self.sinks.close()
        if self.dht is not None:
            self.dht.shutdown()
