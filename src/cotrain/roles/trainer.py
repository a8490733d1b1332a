"""A trainer peer: computes gradients on local micro-batches and steps hivemind.Optimizer with the swarm."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from cotrain import checkpoints as ck
from cotrain.config import AUTO, Config, load_preset
from cotrain.errors import UserError
from cotrain.hardware import Precision, auto_micro_batch, gpu_probe, pad_batch, parallel, resolve_devices
from cotrain.models import (
    build_model,
    check_positions,
    collator_for_run,
    forward_loss,
)
from cotrain.progressbar import StepProgress
from cotrain.sinks.jsonl import JsonlSink
from cotrain.swarm.auth import AccessWatcher, access_for
from cotrain.swarm.backup import BackupGuard
from cotrain.swarm.configrecord import ConfigPublisher, agree_and_publish
from cotrain.swarm.dht import create_dht, visible_maddrs
from cotrain.swarm.healing import SwarmHealer, adopt_swarm_state
from cotrain.swarm.keeper import served_epochs
from cotrain.swarm.optimizer import SwarmOptimizer, build_model_optimizer
from cotrain.swarm.records import LocalMetrics, make_validators, publish_metrics

logger = logging.getLogger(__name__)

SAVE_ON_START_ENV = "COTRAIN_DEBUG_SAVE_ON_START"  # set: save a local checkpoint right after catching up
NAN_AT_STEP_ENV = "COTRAIN_DEBUG_NAN_AT_STEP"  # N: a NaN gradient in the first micro-batch at global step N


def gradient_norm(model: torch.nn.Module, max_norm: float) -> float:
    """The gradients' total norm, clipping them to ``max_norm`` when it is positive: one reduction whose
    result also says whether any gradient is NaN or infinite."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not params:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))


def poison_gradients(model: torch.nn.Module) -> None:
    """Fault injection for tests: one NaN in the first gradient (the loss stays finite)."""
    grad = next(p.grad for p in model.parameters() if p.grad is not None)
    grad.view(-1)[0] = float("nan")


def batches(examples, batch_size: int, collator, seed: int = 0, num_workers: int = 0) -> Iterator[dict]:
    """Endless micro-batches. ``examples`` is an ExampleStream (endless, already in this peer's order) or
    a map-style dataset, shuffled per peer with a new order each epoch and collated by ``num_workers``
    DataLoader worker processes (0: in this process)."""
    if not hasattr(examples, "__getitem__"):
        stream = iter(examples)
        while True:
            yield collator([next(stream) for _ in range(batch_size)])
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        loader = DataLoader(
            examples,
            batch_size=batch_size,
            shuffle=True,
            collate_fn=collator,
            generator=generator,
            num_workers=num_workers,
        )
        yield from loader
        epoch += 1


class Trainer:
    def __init__(self, config: Config, stop: threading.Event):
        self.config = config
        self.stop = stop
        self.dht = None
        self.opt: SwarmOptimizer | None = None
        self.healer: SwarmHealer | None = None
        self.metrics: JsonlSink | None = None
        self.config_publisher: ConfigPublisher | None = None
        self.board = None  # TensorBoard event files in --logging-dir
        self.reports = 0  # global steps reported so far
        self.access_watcher: AccessWatcher | None = None  # a private swarm: stops when the token is refused
        threading.Thread(target=self._cancel_rounds_on_stop, daemon=True, name="stop-rounds").start()

    def run(self) -> int:
        run, peer = self.config.run, self.config.peer
        if peer.torch_threads:
            torch.set_num_threads(peer.torch_threads)
        # a corrupted checkpoint to resume from is reported before anything starts
        self.resume_meta = ck.verify(peer.resume_from) if peer.resume_from else None
        validators, public_key = make_validators(run.run_id)
        access = access_for(run.run_id, peer.access_token, "")
        self.dht = create_dht(peer, validators, access=access)  # first: an unreachable swarm comes first
        if access is not None:
            self.access_watcher = AccessWatcher(self.dht, peer.initial_peers, self.stop)
            self.access_watcher.start()
        from cotrain.data import ExampleStream

        source = peer.dataset_url or peer.dataset_path
        if not source or (peer.dataset_url and peer.dataset_path):
            raise UserError(
                "give one of --dataset-path (a folder made by `cotrain prepare`) or --dataset-url (the URL "
                "of one on an HTTP server)"
            )
        data = ExampleStream(source, seed=peer.seed, cache_dir=peer.cache_dir or None)
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
        tokenizer = self._checked_tokenizer(data)
        devices = resolve_devices(peer.devices)
        precision = Precision(devices[0], fp16=peer.fp16, bf16=peer.bf16)
        from cotrain.data import tokenizer_hash

        # before joining averaging: a peer whose swarm-wide settings differ from the swarm's is refused
        self.config_publisher = agree_and_publish(
            self.dht, run, public_key, "trainer", peer.initial_peers, tokenizer_hash(tokenizer)
        )
        model = build_model(
            run,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        check_positions(model, run.max_seq_length)
        model.train()
        train_model = parallel(model, devices)  # several GPUs: DataParallel over them
        collator = collator_for_run(run, tokenizer, seed=peer.seed)
        if peer.per_device_train_batch_size == AUTO:
            self._choose_micro_batch(model, data, collator, devices[0], precision)
        micro = peer.per_device_train_batch_size * len(devices)
        step_samples = micro * peer.gradient_accumulation_steps
        self.opt = opt = build_model_optimizer(self.dht, run, peer, model, batch_size_per_step=step_samples)
        opt.should_stop = self.stop.is_set
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(
            f"Trainer {self.dht.peer_id} joined run {run.run_id!r}: {n_params / 1e6:.1f}M parameters, "
            f"{data.num_examples} training examples, "
            f"micro-batch {micro} x {peer.gradient_accumulation_steps} "
            f"on {', '.join(map(str, devices))} in {precision.name}"
        )
        if not peer.client_mode:
            maddrs = " ".join(visible_maddrs(self.dht))
            logger.info(f"Others can join through this trainer: --initial-peers {maddrs}")
        self._resume_local(model, tokenizer)
        self._catch_up()
        self.healer = SwarmHealer(self.dht, peer.initial_peers, self.stop, opt)  # re-joins after a partition
        self.healer.start()
        self.metrics = JsonlSink(Path(peer.output_dir) / "metrics.jsonl")
        saved_step = opt.local_epoch
        if os.environ.get(SAVE_ON_START_ENV):  # tests compare this with the state the swarm served
            self._save_local(model, tokenizer)

        stream = batches(self._examples(data), micro, collator, peer.seed, peer.dataloader_num_workers)
        guard = BackupGuard(opt, peer.backup_every_steps)
        guard.after_global_step()  # the first backup: the state this peer starts from
        self.board = self._board()
        max_samples = peer.num_train_epochs * data.num_examples
        seen = 0  # samples of this peer's data consumed, for --num-train-epochs
        last_epoch, loss_sum, mini_steps, contribution = opt.local_epoch, 0.0, 0, 0
        bar = StepProgress(run.target_batch_size)
        nan_at = int(os.environ[NAN_AT_STEP_ENV]) if os.environ.get(NAN_AT_STEP_ENV) else None
        while not self.stop.is_set():
            if self.healer.resync.is_set():  # back from a partition: the swarm's state wins over its own
                self.healer.resync.clear()
                logger.info("Loading the swarm's current state after being cut off")
                if adopt_swarm_state(opt, run.run_id, peer.load_state_timeout, self.stop.is_set):
                    logger.info(f"Adopted the swarm's state at global step {opt.local_epoch}")
                last_epoch, loss_sum, mini_steps = opt.local_epoch, 0.0, 0
            step_loss = 0.0
            for _ in range(peer.gradient_accumulation_steps):
                batch = {k: v.to(devices[0], non_blocking=True) for k, v in next(stream).items()}
                with precision.autocast():
                    loss = forward_loss(train_model, batch)
                loss = loss.float().mean() / peer.gradient_accumulation_steps  # DataParallel: one per GPU
                precision.backward(loss)
                step_loss += loss.item()
            seen += step_samples
            precision.unscale(model)  # fp16: the true gradients, before clipping and before the swarm
            if nan_at is not None and opt.local_epoch >= nan_at:
                logger.warning(f"Fault injection: a NaN gradient at step {opt.local_epoch}")
                poison_gradients(model)
                nan_at = None
            grad_norm = gradient_norm(model, run.max_grad_norm)
            precision.update()
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                opt.step(batch_size=step_samples)
                loss_sum, mini_steps, contribution = (
                    loss_sum + step_loss,
                    mini_steps + 1,
                    contribution + step_samples,
                )
            elif math.isfinite(step_loss) and precision.scaler is not None:
                logger.debug(f"fp16 gradients overflowed; loss scale now {precision.scaler.get_scale():g}")
            else:
                logger.warning(
                    f"Non-finite loss or gradients on this micro-batch (loss {step_loss:.4g}, gradient norm "
                    f"{grad_norm:.4g}): its gradients are dropped, not sent to the swarm"
                )
                if not math.isfinite(step_loss):
                    guard.after_bad_loss()  # restores the backup when the parameters are the cause
            opt.zero_grad()
            bar.update(opt)
            if max_samples and seen >= max_samples:
                logger.info(f"Done {peer.num_train_epochs:g} passes over this peer's data; stopping")
                break
            if opt.local_epoch != last_epoch:
                guard.after_global_step()  # non-finite parameters: restore the backup; else back up when due
                self._report(public_key, loss_sum, mini_steps, contribution)
                if peer.save_steps and opt.local_epoch >= saved_step + peer.save_steps:
                    self._save_local(model, tokenizer)
                    saved_step = opt.local_epoch
                last_epoch, loss_sum, mini_steps = opt.local_epoch, 0.0, 0
                if peer.max_steps and opt.local_epoch >= peer.max_steps:
                    logger.info(f"Reached --max-steps {peer.max_steps}; stopping")
                    break
        bar.close()
        if self.access_watcher is not None and self.access_watcher.refusal:
            raise UserError(self.access_watcher.refusal)
        return 0

    def _checked_tokenizer(self, data):
        """The dataset's tokenizer; with --tokenizer-path, that tokenizer, which must be the same one."""
        peer, run = self.config.peer, self.config.run
        if not peer.tokenizer_path:
            return data.tokenizer
        from cotrain.data import load_tokenizer, tokenizer_hash

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
        from cotrain.data import load_prepared

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
            from cotrain.sinks.tensorboard import TensorBoardSink

            return TensorBoardSink(peer.logging_dir)
        except ImportError as e:
            logger.warning(f"--logging-dir needs TensorBoard ({e}): pip install 'cotrain[tensorboard]'")
            return None

    def _cancel_rounds_on_stop(self) -> None:
        """When asked to stop, cancel pending averaging rounds so a blocked step returns within a second
        (hivemind then falls back to local gradients) and shutdown proceeds in order."""
        self.stop.wait()
        while True:
            opt = self.opt
            if opt is not None:
                for control in (opt.scheduled_grads, opt.scheduled_state):
                    try:
                        if control is not None and not control.done():
                            control.cancel()
                    except Exception as e:
                        logger.debug(f"cancelling an averaging round: {e!r}")
            time.sleep(0.2)

    def _catch_up(self) -> None:
        """Load the swarm's state when others are already training (bounded, with a message)."""
        opt, peer = self.opt, self.config.peer
        tracker = opt.tracker
        deadline = time.monotonic() + min(5.0, peer.load_state_timeout)
        while (
            tracker.global_progress.num_peers <= 1 and time.monotonic() < deadline and not self.stop.is_set()
        ):
            time.sleep(0.2)
        me = self.dht.peer_id.to_bytes()
        offers = served_epochs(self.dht, self.config.run.run_id)
        served = max((e for p, e in offers.items() if p != me), default=0)
        swarm_step = max(tracker.global_epoch, int(served))  # with no trainer left, a monitor may still serve
        if swarm_step > opt.local_epoch:
            logger.info(
                f"The swarm is at step {swarm_step} ({tracker.global_progress.num_peers} peers): "
                f"loading its current state (waiting up to {peer.load_state_timeout:.0f} s)"
            )
            opt.load_state_from_peers()
            logger.info(f"Starting from global step {opt.local_epoch}")

    def _resume_local(self, model: torch.nn.Module, tokenizer) -> None:
        """Resume from --resume-from, or from the newest good checkpoint in OUTPUT_DIR/checkpoints unless
        --overwrite-output-dir. The swarm's state still wins when it is newer (see _catch_up)."""
        peer, opt = self.config.peer, self.opt
        if peer.resume_from:
            path, meta = Path(peer.resume_from), self.resume_meta or ck.verify(peer.resume_from)
        elif peer.overwrite_output_dir:
            return
        else:
            found = ck.latest_good(Path(peer.output_dir) / "checkpoints")
            if found is None:
                return
            path, meta = found
        from cotrain.data import tokenizer_hash

        if meta.get("tokenizer_hash") != tokenizer_hash(tokenizer):
            raise UserError(f"checkpoint {path} was made with another tokenizer than this dataset's")
        averager = opt.state_averager
        with averager.lock_averaged_tensors:
            main = averager.main_parameters
            ck.load_into(path, model, averager.optimizer, averager.scheduler, meta=meta, params=main)
            averager.local_epoch = int(meta["step"])
        if not averager.reuse_tensors:
            averager._load_local_tensors_into_averager_()
        opt.tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)
        if not opt.client_mode:
            averager.state_sharing_priority = opt.local_epoch
        logger.info(f"Resumed from local checkpoint {path} (global step {opt.local_epoch})")

    def _save_local(self, model: torch.nn.Module, tokenizer) -> None:
        peer, averager = self.config.peer, self.opt.state_averager
        try:
            with averager.lock_averaged_tensors:
                path = ck.save_checkpoint(
                    Path(peer.output_dir) / "checkpoints",
                    self.opt.local_epoch,
                    model,
                    averager.optimizer,
                    averager.scheduler,
                    self.config.to_dict(),
                    tokenizer,
                    keep=peer.save_total_limit,
                    source="trainer",
                    params=averager.main_parameters,
                )
            logger.info(f"Saved local checkpoint {path}")
        except OSError as e:  # a full disk must not stop training
            logger.warning(f"Saving a local checkpoint failed: {e}")

    def _report(self, public_key: bytes, loss_sum: float, mini_steps: int, contribution: int) -> None:
        opt, run, peer = self.opt, self.config.run, self.config.peer
        sps = float(opt.tracker.performance_ema.samples_per_second)
        record = LocalMetrics(
            step=opt.local_epoch,
            samples_per_second=min(max(sps, 0.0), 1e5) if math.isfinite(sps) else 0.0,
            samples_accumulated=contribution,
            loss=float(loss_sum),
            mini_steps=mini_steps,
            group_size=int(opt.last_group_size),
            client_mode=bool(peer.client_mode),
            time=time.time(),
            peer_id=str(self.dht.peer_id)[:128],
        )
        publish_metrics(self.dht, run.run_id, public_key, record, peer.statistics_expiration)
        mean = loss_sum / mini_steps if mini_steps else float("nan")
        first, self.reports = self.reports == 0, self.reports + 1
        if opt.local_epoch % peer.logging_steps == 0 or (first and peer.logging_first_step):
            logger.info(
                f"step {opt.local_epoch} | loss {mean:.4f} | averaged with {opt.last_group_size} peers | "
                f"{sps:.1f} samples/s | contribution {contribution} samples | "
                f"rounds averaged {opt.rounds_averaged}, failed {opt.rounds_failed}"
            )
            if self.board is not None:
                self.board.write(
                    opt.local_epoch,
                    {"loss": mean if mini_steps else None, "samples_per_second": record.samples_per_second,
                     "group_size": int(opt.last_group_size), "contribution": contribution},
                )
        if self.metrics is not None:
            self.metrics.write(
                opt.local_epoch,
                {
                    "step": opt.local_epoch,
                    "loss": mean if mini_steps else None,
                    "group_size": int(opt.last_group_size),
                    "samples_per_second": record.samples_per_second,
                    "contribution": contribution,
                    "rounds_averaged": opt.rounds_averaged,
                    "rounds_failed": opt.rounds_failed,
                    "rejoins": self.healer.rejoins if self.healer is not None else 0,
                    "peer_id": record.peer_id,
                    "time": record.time,
                },
            )

    def close(self) -> None:
        if self.config_publisher is not None:
            self.config_publisher.close()
        if self.healer is not None:
            self.healer.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close()
        if self.opt is not None:
            try:
                self.opt.shutdown()
            except Exception as e:
                logger.debug(f"optimizer shutdown: {e!r}")
        if self.dht is not None:
            self.dht.shutdown()
