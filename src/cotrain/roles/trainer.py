"""A trainer peer: a plain loop over the engine. Data, model, micro-steps, ``peer.step``, report.

join the swarm (and take its settings when this peer named none) -> open the dataset -> agree on the run
config -> build the model -> SwarmPeer -> resume / catch up -> loop: micro-batches forward and backward,
peer.step(), a metrics line per global step -> stop at --max-steps, an epoch limit or a signal.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from cotrain import checkpoints as ck
from cotrain import faults
from cotrain.config import AUTO, Config, load_preset
from cotrain.data import ExampleStream, load_prepared, load_tokenizer, tokenizer_hash
from cotrain.engine import SwarmConnection, SwarmPeer, accumulate_gradients, batches, take_swarm_settings
from cotrain.errors import UserError
from cotrain.host.hardware import Precision, auto_micro_batch, gpu_probe, pad_batch, parallel, resolve_devices
from cotrain.models import (
    check_positions,
    collator_for_run,
    enable_gradient_checkpointing,
    forward_loss,
    model_for_tokenizer,
)
from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
from cotrain.progressbar import StepProgress
from cotrain.registry import strategy_class
from cotrain.roles.ranks import node_world, start_node, stop_node
from cotrain.sinks.jsonl import JsonlSink
from cotrain.sinks.tensorboard import TensorBoardSink

logger = logging.getLogger(__name__)


def strategy_words(config: Config) -> str:
    """The run's strategy for the trainer's first line: sync, or diloco with its round and outer step."""
    return strategy_class(config.run.strategy).words(config.run, config.peer)


class Trainer:
    def __init__(self, config: Config, stop: threading.Event):
        self.config = config
        self.stop = stop
        self.connection: SwarmConnection | None = None
        self.peer: SwarmPeer | None = None
        self.metrics: JsonlSink | None = None
        self.events: JsonlSink | None = (
            None  # OUTPUT_DIR/events.jsonl: joined, started, dropped, ..., stopped
        )
        self.board = None  # TensorBoard event files in --logging-dir
        self.node = None  # a peer of several ranks: this rank's (0's) part of it (cotrain.roles.ranks)
        self.ranks = None  # the other ranks, where this trainer launched them

    def run(self) -> int:
        config = self.config
        # a corrupted checkpoint to resume from is reported before anything starts
        resume_meta = ck.verify(config.peer.resume_from) if config.peer.resume_from else None
        # first: an unreachable swarm is the first thing to report
        self.connection = SwarmConnection(config.run.run_id, config.peer, role="trainer", stop=self.stop)
        took = take_swarm_settings(self.connection, config)  # only an address: the swarm's, from its record
        run, peer = config.run, config.peer
        self.events = JsonlSink(Path(peer.output_dir) / "events.jsonl")
        data = self._open_dataset()
        tokenizer = self._checked_tokenizer(data)
        devices = resolve_devices(peer.devices)
        precision = Precision(devices[0], fp16=peer.fp16, bf16=peer.bf16)

        # before joining averaging: a peer whose swarm-wide settings differ from the swarm's is refused
        self.connection.agree(run, tokenizer_hash(tokenizer), manifest_sha256=data.manifest_sha256)
        model = model_for_tokenizer(run, tokenizer)
        check_positions(model, run.max_seq_length)
        model.train()
        if peer.gradient_checkpointing:  # before the micro-batch probe, which then measures with it on
            enable_gradient_checkpointing(model)
        optimizer = optimizer_factory(run)
        world = node_world(config)
        if world > 1:  # ranks of their own, the model sharded over them; `model` stays here as the replica
            self.node, self.ranks = start_node(config, world, model, self.stop, data.manifest_sha256)
            devices, precision = [self.node.device], Precision(self.node.device, bf16=peer.bf16)
            optimizer, train_model = self.node.inner_optimizer(optimizer), None
        else:
            train_model = parallel(model, devices)  # several GPUs under sync: DataParallel over them
        collator = collator_for_run(run, tokenizer, seed=peer.seed)
        if peer.per_device_train_batch_size == AUTO:
            self._choose_micro_batch(model, data, collator, devices[0], precision)
        micro = peer.per_device_train_batch_size * max(world, len(devices))
        step_samples = micro * peer.gradient_accumulation_steps
        self.peer = swarm = SwarmPeer(
            model,
            optimizer,
            scheduler_factory(run),
            config=(run, peer),
            connection=self.connection,
            params=parameter_groups(model, run.weight_decay),
            batch_size_per_step=step_samples,
            stop=self.stop,
            grad_scaler=precision.scaler,
            events=self._event,
            start=False,  # it resumes from its own checkpoint first, then catches up
        )
        if self.node is not None:
            swarm.attach_node(self.node)
        logger.info(
            f"Trainer {swarm.peer_id} joined run {run.run_id!r}: "
            f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
            f"{data.num_examples} training examples, "
            f"micro-batch {micro} x {peer.gradient_accumulation_steps} "
            f"on {', '.join(map(str, devices))}{f' x {world} ranks' if world > 1 else ''} "
            f"in {precision.name}, {strategy_words(config)}"
        )
        joined = {
            "peer_id": swarm.peer_id,
            "run_id": run.run_id,
            "preset": run.preset,
            "took_settings": took,
            "strategy": run.strategy,
        }
        self._event(
            "joined", {**joined, "micro_batch": micro, "accumulation": peer.gradient_accumulation_steps}
        )
        if not peer.client_mode:
            logger.info(f"Others can join through this trainer: --initial-peers {' '.join(swarm.maddrs)}")
        self._resume_local(tokenizer, resume_meta)
        swarm.catch_up()
        if self.node is not None:  # every rank starts from this peer's state
            self.node.push()
        swarm.start()
        self.metrics = JsonlSink(Path(peer.output_dir) / "metrics.jsonl")
        self.board = self._board()
        saved_step = swarm.global_step
        if faults.enabled(faults.SAVE_ON_START):  # tests compare this with the state the swarm served
            self._save_local(tokenizer)

        stream = batches(self._examples(data), micro, collator, peer.seed, peer.dataloader_num_workers)
        stream = faults.attack_batches(stream, model.config.vocab_size)  # COTRAIN_ATTACK=label-shuffle
        max_samples = peer.num_train_epochs * data.num_examples
        seen = 0  # samples of this peer's data consumed, for --num-train-epochs
        # samples the swarm accumulates per global step (diloco: per outer round)
        bar = StepProgress(
            strategy_class(run.strategy).samples_per_step(run.target_batch_size, run.local_steps)
        )
        # the loop of examples/custom_loop.py, with the trainer's data and limits
        while not self.stop.is_set():
            if self.node is not None:  # every rank: forward and backward over micro-batches of its own
                loss = self.node.accumulate(stream, peer.gradient_accumulation_steps, precision, forward_loss)
            else:  # forward and backward over the step's micro-batches
                loss = accumulate_gradients(
                    train_model, stream, peer.gradient_accumulation_steps, devices[0], precision, forward_loss
                )
            seen += step_samples
            if swarm.step(batch_size=step_samples, loss=loss):  # a global step of the swarm happened
                self._write_report(swarm.last_report)
                if peer.save_steps and swarm.global_step >= saved_step + peer.save_steps:
                    self._save_local(tokenizer)
                    saved_step = swarm.global_step
            bar.update(swarm.global_step, swarm.strategy.progress.swarm_samples, swarm.num_peers)
            reason = self._done(swarm.global_step, seen, max_samples)
            if reason:
                self._event("stopping", {"step": swarm.global_step, "reason": reason})
                swarm.leave_final_state()
                break
        bar.close()
        if swarm.refusal:
            raise UserError(swarm.refusal)
        if self.ranks is not None and self.ranks.failure:
            raise UserError(f"{self.ranks.failure}: this peer stops")
        return 0

    def _done(self, step: int, seen: int, max_samples: int) -> str | None:
        """Why this trainer stops now (--num-train-epochs, --max-steps), or None."""
        peer = self.config.peer
        if max_samples and seen >= max_samples:
            logger.info(f"Done {peer.num_train_epochs:g} passes over this peer's data; stopping")
            return "num_train_epochs"
        if peer.max_steps and step >= peer.max_steps:
            logger.info(f"Reached --max-steps {peer.max_steps}; stopping")
            return "max_steps"
        return None

    def _open_dataset(self):
        """This peer's training examples, checked against the run's objective and sequence length."""

        run, peer = self.config.run, self.config.peer
        source = peer.dataset_url or peer.dataset_path
        if not source or (peer.dataset_url and peer.dataset_path):
            raise UserError(
                "give one of --dataset-path (a folder made by `cotrain prepare`) or --dataset-url (the URL "
                "of one on an HTTP server)"
            )
        # a downloaded manifest must be the one the peer the user was told to join trains with (its record
        # carries the manifest's sha256): a plain-HTTP server, or something on the way, cannot alter it
        vouched = self.connection.initial_peer_record() if peer.dataset_url and self.connection else None
        expected = vouched[1].manifest_sha256 if vouched is not None else ""
        data = ExampleStream(
            source, seed=peer.seed, cache_dir=peer.cache_dir or None, expected_manifest=expected
        )
        if expected:
            logger.info(f"The dataset's manifest is the one initial peer {vouched[0]} trains with")
        if data.manifest.get("objective") != run.objective:
            raise UserError(
                f"dataset {source} was prepared for {data.manifest.get('objective')!r}, "
                f"but preset {run.preset} trains {run.objective!r}"
            )
        if data.manifest.get("max_length", 0) > run.max_seq_length:
            raise UserError(
                f"dataset {source} has examples of up to {data.manifest['max_length']} tokens, "
                f"longer than max_seq_length {run.max_seq_length}"
            )
        return data

    def _checked_tokenizer(self, data):
        """The dataset's tokenizer; with --tokenizer-path, that tokenizer, which must be the same one."""
        peer, run = self.config.peer, self.config.run
        if not peer.tokenizer_path:
            return data.tokenizer

        tokenizer = load_tokenizer(peer.tokenizer_path, run.objective)
        if tokenizer_hash(tokenizer) != data.manifest.get("tokenizer_hash"):
            raise UserError(
                f"--tokenizer-path {peer.tokenizer_path} is not the tokenizer the dataset was prepared with; "
                "leave it out to use the dataset's"
            )
        return tokenizer

    def _examples(self, data):
        """With --dataloader-num-workers, a local dataset is read as a map-style dataset that DataLoader
        workers load and collate; otherwise the shard stream, collated in this process."""
        peer = self.config.peer
        if peer.dataloader_num_workers <= 0:
            return data
        if peer.dataset_url:
            logger.info("--dataloader-num-workers applies to a local --dataset-path; streaming from the URL")
            return data

        logger.info(f"Loading micro-batches with {peer.dataloader_num_workers} DataLoader worker processes")
        return load_prepared(peer.dataset_path).train

    def _choose_micro_batch(self, model, data, collator, device, precision: Precision) -> None:
        """--per-device-train-batch-size auto: the largest micro-batch that fits (GPU) or CPU_MICRO_BATCH,
        with gradient accumulation making up the preset's samples per optimizer step."""
        run, peer = self.config.run, self.config.peer
        preset_micro = load_preset(run.preset).get("peer", {}).get("per_device_train_batch_size", 4)
        wanted = min(preset_micro * peer.gradient_accumulation_steps, run.target_batch_size)
        fits = None
        if device.type == "cuda":
            examples = iter(data)
            pool = [next(examples) for _ in range(min(wanted, 64))]
            pad_id = getattr(model.config, "pad_token_id", None) or 0

            def make_batch(size: int) -> dict:
                rows = [pool[i % len(pool)] for i in range(size)]
                return pad_batch(collator(rows), run.max_seq_length, pad_id)

            fits = gpu_probe(model, make_batch, forward_loss, device, precision)
        micro, accumulation = auto_micro_batch(wanted, device, fits)
        peer.per_device_train_batch_size, peer.gradient_accumulation_steps = micro, accumulation
        logger.info(
            f"--per-device-train-batch-size auto: {micro} per micro-batch x {accumulation} accumulated "
            f"({wanted} samples per step) on {device}"
        )

    def _board(self):
        """TensorBoard event files of this trainer's steps in --logging-dir (needs tensorboard)."""
        peer = self.config.peer
        if not peer.logging_dir:
            return None
        try:
            return TensorBoardSink(peer.logging_dir)
        except ImportError as e:
            logger.warning(f"--logging-dir needs TensorBoard ({e}): pip install 'cotrain[tensorboard]'")
            return None

    def _resume_local(self, tokenizer, resume_meta: dict | None) -> None:
        """Resume from --resume-from, or from the newest good checkpoint in OUTPUT_DIR/checkpoints unless
        --overwrite-output-dir. The swarm's state still wins when it is newer (see SwarmPeer.catch_up)."""
        peer = self.config.peer
        if peer.resume_from:
            path, meta = Path(peer.resume_from), resume_meta or ck.verify(peer.resume_from)
        elif peer.overwrite_output_dir:
            return
        else:
            found = ck.latest_good(Path(peer.output_dir) / "checkpoints")
            if found is None:
                return
            path, meta = found

        if meta.get("tokenizer_hash") != tokenizer_hash(tokenizer):
            raise UserError(f"checkpoint {path} was made with another tokenizer than this dataset's")
        self.peer.load_checkpoint(path, meta)
        logger.info(f"Resumed from local checkpoint {path} (global step {self.peer.global_step})")
        self._event("resumed", {"path": str(path), "step": self.peer.global_step})

    def _save_local(self, tokenizer) -> None:
        peer = self.config.peer
        try:
            path = self.peer.save_checkpoint(
                Path(peer.output_dir) / "checkpoints",
                self.config.to_dict(),
                tokenizer,
                keep=peer.save_total_limit,
                source="trainer",
            )
            logger.info(f"Saved local checkpoint {path}")
        except OSError as e:  # a full disk must not stop training
            logger.warning(f"Saving a local checkpoint failed: {e}")

    def _event(self, name: str, fields: dict) -> None:
        """One line of OUTPUT_DIR/events.jsonl: what happened to this trainer, for scripts and tests."""
        if self.events is not None:
            self.events.write(0, {"event": name, "time": time.time(), **fields})

    def _write_report(self, report: dict) -> None:
        """The global step's line in OUTPUT_DIR/metrics.jsonl, and in TensorBoard when it was logged."""
        row = {k: v for k, v in report.items() if k != "logged"}
        self.metrics.write(row["step"], row)
        if self.board is not None and report["logged"]:
            keys = ["loss", "samples_per_second", "group_size", "contribution"]
            keys += strategy_class(row["strategy"]).peer_fields  # diloco: the schedule's position, bytes sent
            self.board.write(row["step"], {key: row[key] for key in keys})

    def close(self) -> None:
        stop_node(self.node, self.ranks)
        if self.metrics is not None:
            self.metrics.close()
        if self.events is not None:
            self.events.close()
        if self.board is not None:
            self.board.close()
        if self.peer is not None:
            self.peer.shutdown()  # its strategy's averagers, then the DHT
        elif self.connection is not None:
            self.connection.close()
