"""The monitor: the swarm's first peer. Welcomes others onto the DHT and aggregates the trainers' metrics."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cotrain.checkpoints import step_dir
from cotrain.config import Config, RunConfig, write_atomic
from cotrain.dashboard.server import DashboardServer
from cotrain.dashboard.view import SwarmView
from cotrain.data import DataError, manifest_sha256
from cotrain.engine.join import SwarmConnection, take_swarm_settings
from cotrain.host.layout import run_state_layout
from cotrain.hub import HubUploader
from cotrain.net.metrics import EvalMetrics, LocalMetrics, read_evaluations, read_metrics
from cotrain.registry import DEFAULT_STRATEGY, strategy_class
from cotrain.roles.keeper import StateKeeper
from cotrain.sinks import SinkSet, build_sinks
from cotrain.sinks.prometheus import PrometheusSink
from cotrain.snapshot import read_progress, snapshot

if TYPE_CHECKING:
    from cotrain.hub import HubUploader
    from cotrain.roles.keeper import StateKeeper

logger = logging.getLogger(__name__)


MAX_STEPS_AHEAD = 1000  # a record this far ahead of every other peer's step is ignored


def plausible(records: dict[bytes, Any]) -> dict[bytes, LocalMetrics]:
    """The records whose values pass the schema, by whatever path they arrived, and whose step is not far
    ahead of every other peer's: a single peer cannot skew the swarm's step or aggregates."""
    valid = {}
    for key, record in records.items():
        try:
            valid[key] = LocalMetrics.parse_obj(record if isinstance(record, dict) else dict(record))
        except (ValueError, TypeError):
            logger.debug(f"ignoring an out-of-schema metrics record: {record!r}")
    steps = sorted(r.step for r in valid.values())
    if len(steps) < 2:
        return valid
    return {k: r for k, r in valid.items() if r.step <= steps[-2] + MAX_STEPS_AHEAD}


def aggregate(step: int, records: dict[bytes, LocalMetrics], strategy: str = DEFAULT_STRATEGY) -> dict:
    """One line of the swarm's metrics for a global step, as the seed recipe computes it (implausible
    records ignored). With diloco the step is an outer round, and the line adds the inner steps (the largest
    any peer reports) and the payload of the peers' last outer all-reduce (the largest one peer sent, and the
    total)."""
    values = list(plausible(records).values())
    mini_steps = sum(r.mini_steps for r in values)
    current = [r for r in values if r.step == step]
    line = {
        "step": step,
        "strategy": strategy,
        "loss": sum(r.loss for r in values) / mini_steps if mini_steps else None,
        "alive_peers": len(values),
        "samples": sum(r.samples_accumulated for r in values),
        "samples_per_second": sum(r.samples_per_second for r in values),
        "max_group_size": max((r.group_size for r in current), default=1),
        "client_peers": sum(r.client_mode for r in values),
        "time": time.time(),
    }
    line.update(strategy_class(strategy).swarm_fields(values))
    return line


def step_log_line(line: dict) -> str:
    """The monitor's log line for a row of ``aggregate``."""
    text = (
        f"step {line['step']} | loss {line['loss'] or float('nan'):.5f} | {line['alive_peers']} peers | "
        f"{line['samples']} samples | {line['samples_per_second']:.1f} samples/s"
    )
    return text + strategy_class(line.get("strategy", DEFAULT_STRATEGY)).step_words(line)


def eval_row(record: EvalMetrics) -> dict:
    """One line of an evaluation peer's metrics; its keys start with ``eval_`` so that per-step readers of the
    same JSONL (loss curves, the demo) tell the two kinds of line apart."""
    row: dict = {"kind": "eval", "step": record.step}
    for name in ("loss", "perplexity", "lm_loss", "mlm_accuracy", "sop_accuracy", "examples"):
        value = getattr(record, name)
        if value is not None:
            row[f"eval_{name}"] = value
    row["eval_peer"] = record.peer_id
    row["time"] = record.time
    return row


def join_command(maddrs: list[str], run_id: str, private: bool = False, dataset_url: str = "") -> str:
    """The command others join with: the dataset's URL when the monitor was given one, else a local folder."""
    peers = " ".join(maddrs)
    token = " --access-token TOKEN_FILE" if private else ""
    data = f"--dataset-url {dataset_url}" if dataset_url else "--dataset-path DATA"
    return f"cotrain train --run-id {run_id} --initial-peers {peers} {data}{token}"


def api_join(maddrs: list[str], run: RunConfig) -> str:
    """How a loop of one's own (cotrain.SwarmPeer) joins: the run settings it shares with the swarm, those
    that differ from the API's defaults."""
    from cotrain.engine.settings import API_RUN, configs_of  # the API's side, loaded only here

    ours = dataclasses.asdict(run)
    default = dataclasses.asdict(configs_of({"run_id": run.run_id, "target_batch_size": 1}, None)[0])
    shared = [
        f"{name}={ours[name]!r}"
        for name in API_RUN
        if name in ("run_id", "target_batch_size") or ours[name] != default[name]
    ]
    return f"cotrain.SwarmPeer(model, optimizer, {', '.join(shared)}, initial_peers={maddrs!r})"


def describe_strategy(run: RunConfig) -> str:
    """The run's strategy in a few words, for log lines."""
    return strategy_class(run.strategy).words(run)


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
        self.reducer: Any = None  # the auxiliary reducer (cotrain.hivemind_ext.auxiliary.Reducer)
        self.uploader: HubUploader | None = None
        self.evaluations_seen: dict[bytes, tuple[int, float]] = {}
        self.connection: SwarmConnection | None = None

    def _manifest_sha256(self) -> str:
        """The sha256 of the dataset manifest this monitor was given (--dataset-path or --dataset-url), which
        its config record carries for trainers to check the manifest they download against; "" without one
        (or when it cannot be read now: the monitor needs no dataset to run)."""

        source = self.config.peer.dataset_url or self.config.peer.dataset_path
        if not source:
            return ""
        try:
            return manifest_sha256(source)
        except (DataError, OSError) as e:
            logger.warning(f"The dataset's manifest could not be read ({e}): trainers cannot check theirs")
            return ""

    def run(self) -> int:
        out = Path(self.config.peer.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "initial_peers.txt").unlink(missing_ok=True)  # a previous run's: written again once ready
        # a private swarm (--authority-key): the monitor admits token holders only
        self.connection = connection = SwarmConnection(
            self.config.run.run_id, self.config.peer, role="monitor", client_mode=False, stop=self.stop
        )
        self.dht = connection.dht
        if self.config.peer.initial_peers:  # a second monitor of a running swarm, given only its address
            take_swarm_settings(connection, self.config)
        run, peer = self.config.run, self.config.peer
        connection.agree(run, manifest_sha256=self._manifest_sha256())
        maddrs = connection.maddrs()
        join = join_command(maddrs, run.run_id, connection.access is not None, peer.dataset_url)
        self.sinks = build_sinks(out, run.run_id, peer.tensorboard_dir, peer.wandb_project)
        view = SwarmView(run.run_id, join, run.target_batch_size, run.strategy, run.local_steps)
        self._start_dashboard(view, out)
        layout = self._run_layout(out)
        self._start_checkpoints(out, layout)
        self._start_reducer(layout)
        if "preset" not in self.config.run_given:  # no model named: the run may be a loop of one's own's too
            join += "\nor, from a training loop of one's own (docs/api.md):\n  " + api_join(maddrs, run)
        logger.info(f"Monitor of run {run.run_id!r} is up, {describe_strategy(run)}. To join, run:\n  {join}")
        # last, after the line that says how to join: a script that waits for the file finds the line logged
        (out / "initial_peers.txt").write_text("\n".join(maddrs) + "\n")
        period = min(peer.refresh_period, DASHBOARD_TICK) if self.dashboard else peer.refresh_period

        current_step = -1
        while not self.stop.wait(period):
            try:
                records = plausible(read_metrics(self.dht, run.run_id))
                progress = read_progress(self.dht, run.run_id) if self.dashboard else {}
            except Exception as e:  # network trouble degrades, it never kills the monitor
                logger.warning(f"Reading metrics from the DHT failed: {e!r}")
                continue
            state = snapshot(
                run.run_id, run.target_batch_size, records, progress, strategy=run.strategy,
                local_steps=run.local_steps,
            )  # fmt: skip
            view.update(state)
            if self.keeper is not None and (saved := self.keeper.saved_step) >= 0:  # the checkpoint card
                view.record_checkpoint(saved, str(step_dir(self.keeper.root, saved)))
            self._log_evaluations(view)
            if self.prometheus is not None:
                self.prometheus.write(state["global_step"], state)
            if not records:
                continue
            latest = max(r.step for r in records.values())
            if self.keeper is not None:
                self.keeper.notice_step(latest)
                if self.keeper.global_step > self.keeper.saved_step and connection.peers_in_role("leaving"):
                    self.keeper.notice_leaving()  # trainers are done: their final state is due now
            if latest == current_step:
                continue
            current_step = latest
            line = aggregate(latest, records, run.strategy)
            self.sinks.write(latest, line)
            view.add_step(line)
            logger.info(step_log_line(line))
        return 0

    def _log_evaluations(self, view: SwarmView) -> None:
        """Write each evaluation peer's new records to the sinks and the dashboard, once each."""
        try:
            found = read_evaluations(self.dht, self.config.run.run_id)
        except Exception as e:  # network trouble degrades, it never kills the monitor
            logger.debug(f"Reading evaluations from the DHT failed: {e!r}")
            return
        new = [(k, r) for k, r in found.items() if self.evaluations_seen.get(k) != (r.step, r.time)]
        for key, record in sorted(new, key=lambda kr: (kr[1].step, kr[1].time)):
            self.evaluations_seen[key] = (record.step, record.time)
            row = eval_row(record)
            self.sinks.write(record.step, row)
            view.add_evaluation(row)
            logger.info(
                f"eval step {record.step} | held-out loss {record.loss:.5f} | "
                f"perplexity {record.perplexity:.2f}"
            )

    def _checkpointing(self) -> bool:
        peer = self.config.peer
        return (peer.save_every > 0 and peer.store_checkpoints) or peer.resume

    def _run_layout(self, out: Path) -> tuple[Any, Any] | None:
        """(The run's tokenizer, saved among the checkpoints that carry it, a LayoutModel of the run's model)
        where checkpoints or the auxiliary reducer need the model's shapes; None where neither does or where
        there is no tokenizer to be had (said in one line)."""
        peer = self.config.peer
        if not self._checkpointing() and not peer.reduce:
            return None

        root = out / "checkpoints"
        sources = peer.tokenizer_path or peer.dataset_path or peer.dataset_url or peer.resume
        found = run_state_layout(self.config, root, root / "tokenizer") if sources else None
        if found is None:
            what = {
                (True, True): "Checkpoints and reducing for client-mode trainers are",
                (True, False): "Checkpoints are",
                (False, True): "Reducing for client-mode trainers is",
            }[(self._checkpointing(), bool(peer.reduce))]
            logger.info(
                f"{what} off: the monitor needs the model's shapes; give --dataset-path, --dataset-url or "
                "--tokenizer-path"
            )
        return found

    def _start_reducer(self, found: tuple[Any, Any] | None) -> None:
        """Reduce all-reduce parts for the trainers as an auxiliary peer (built here, in the main thread)."""
        run = self.config.run
        if not self.config.peer.reduce:
            logger.info("Not reducing for client-mode trainers (--no-reduce)")
            return
        if found is None:
            return

        # a model of its own: the keeper's holds the swarm's state, which the reducer's copies must not touch
        self.reducer = strategy_class(run.strategy).reducer(
            self.dht, run, self.config.peer, copy.deepcopy(found[1])
        )
        if self.reducer is None:
            logger.info(
                f"Not reducing for client-mode trainers: strategy {run.strategy} has no auxiliary reducer"
            )
            return
        self.reducer.start()
        logger.info(
            f"Reducing the trainers' {self.reducer.what} as an auxiliary peer (weight 0): trainers behind "
            "NAT (--client-mode) average through this monitor"
        )

    def _start_checkpoints(self, out: Path, found: tuple[Any, Any] | None) -> None:
        """Keep, checkpoint and serve the swarm's state (created here, in the main thread), and upload it."""
        peer = self.config.peer
        root = out / "checkpoints"
        saving = peer.save_every > 0 and peer.store_checkpoints
        if not self._checkpointing():
            logger.info("Checkpoints are off (--save-every 0 or --no-store-checkpoints)")
            return
        if found is None:
            return

        tokenizer, layout = found
        self.keeper = StateKeeper(self.dht, self.config, tokenizer, root, self.stop, model=layout)
        if peer.resume:
            self.keeper.resume()
        if saving:
            self.keeper.start()
            self.connection.announce_keeping_state()  # trainers at their end leave their final state here
            logger.info(f"Checkpoints every {peer.save_every} global steps into {root}")
        if peer.push_to_hub:
            work_dir = Path(peer.repo_path) if peer.repo_path else out / "hub"
            self.uploader = HubUploader(
                root, peer.push_to_hub, peer.upload_every, work_dir, self.stop, public=peer.hub_public
            )
            self.uploader.start()
            visibility = "public (--hub-public)" if peer.hub_public else "private (--hub-public: public)"
            logger.info(
                f"Uploading the newest checkpoint to {peer.push_to_hub} every {peer.upload_every:g}s (a new "
                f"repository is created {visibility}; an existing one keeps its visibility)"
            )

    def _start_dashboard(self, view: SwarmView, out: Path) -> None:
        """Serve the dashboard unless disabled; a missing extra or a busy port is one line, not a failure."""
        peer = self.config.peer
        url_file = out / "dashboard_url.txt"
        url_file.unlink(missing_ok=True)
        if peer.dashboard_port < 0:
            return
        try:
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
        write_atomic(url_file, self.dashboard.url + "\n")
        logger.info(f"Dashboard: {self.dashboard.url}")

    def close(self) -> None:
        if self.reducer is not None:
            done, failed = self.reducer.rounds
            logger.info(f"Reduced {done} {self.reducer.what} for the trainers ({failed} failed)")
            self.reducer.close()
        if self.keeper is not None:
            self.keeper.shutdown()
        if self.dashboard is not None:
            self.dashboard.close()
        if self.sinks is not None:
            self.sinks.close()
        if self.connection is not None:
            self.connection.close()
