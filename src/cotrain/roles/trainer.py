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
from cotrain.config import Config
from cotrain.errors import UserError
from cotrain.models import build_model, forward_loss, optimizer_factory, parameter_groups, scheduler_factory
from cotrain.progressbar import StepProgress
from cotrain.swarm.dht import create_dht
from cotrain.swarm.keeper import served_epochs
from cotrain.swarm.optimizer import SwarmOptimizer, build_optimizer
from cotrain.swarm.records import LocalMetrics, make_validators, publish_metrics

logger = logging.getLogger(__name__)

SAVE_ON_START_ENV = "COTRAIN_DEBUG_SAVE_ON_START"  # set: save a local checkpoint right after catching up


def batches(examples, batch_size: int, collator, seed: int = 0) -> Iterator[dict]:
    """Endless micro-batches. ``examples`` is an ExampleStream (endless, already in this peer's order) or
    a map-style dataset, shuffled per peer with a new order each epoch."""
    if not hasattr(examples, "__getitem__"):
        stream = iter(examples)
        while True:
            yield collator([next(stream) for _ in range(batch_size)])
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
        loader = DataLoader(
            examples, batch_size=batch_size, shuffle=True, collate_fn=collator, generator=generator
        )
        yield from loader
        epoch += 1


class Trainer:
    def __init__(self, config: Config, stop: threading.Event):
        self.config = config
        self.stop = stop
        self.dht = None
        self.opt: SwarmOptimizer | None = None
        threading.Thread(target=self._cancel_rounds_on_stop, daemon=True, name="stop-rounds").start()

    def run(self) -> int:
        run, peer = self.config.run, self.config.peer
        if peer.torch_threads:
            torch.set_num_threads(peer.torch_threads)
        validators, public_key = make_validators(run.run_id)
        self.dht = create_dht(peer, validators)  # first: an unreachable swarm is the first thing to report
        from cotrain.data import AlbertCollator, ExampleStream

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
        tokenizer = data.tokenizer
        model = build_model(run, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        model.train()

        micro = peer.per_device_train_batch_size
        step_samples = micro * peer.gradient_accumulation_steps
        self.opt = opt = build_optimizer(
            self.dht,
            run,
            peer,
            parameter_groups(model, run.weight_decay),
            optimizer_factory(run),
            scheduler_factory(run),
            batch_size_per_step=step_samples,
        )
        opt.should_stop = self.stop.is_set
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(
            f"Trainer {self.dht.peer_id} joined run {run.run_id!r}: {n_params / 1e6:.1f}M parameters, "
            f"{data.num_examples} training examples, micro-batch {micro} x {peer.gradient_accumulation_steps}"
        )
        self._resume_local(model, tokenizer)
        self._catch_up()
        saved_step = opt.local_epoch
        if os.environ.get(SAVE_ON_START_ENV):  # tests compare this with the state the swarm served
            self._save_local(model, tokenizer)

        collator = AlbertCollator(tokenizer, mlm_probability=run.mlm_probability, seed=peer.seed)
        stream = batches(data, micro, collator, peer.seed)
        last_epoch, loss_sum, mini_steps, contribution = opt.local_epoch, 0.0, 0, 0
        bar = StepProgress(run.target_batch_size)
        while not self.stop.is_set():
            step_loss = 0.0
            for _ in range(peer.gradient_accumulation_steps):
                loss = forward_loss(model, next(stream)) / peer.gradient_accumulation_steps
                loss.backward()
                step_loss += loss.item()
            if run.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
            if math.isfinite(step_loss):
                opt.step(batch_size=step_samples)
                loss_sum, mini_steps, contribution = (
                    loss_sum + step_loss,
                    mini_steps + 1,
                    contribution + step_samples,
                )
            else:
                logger.warning(
                    "Non-finite loss on this micro-batch: its gradients are dropped, not sent to the swarm"
                )
            opt.zero_grad()
            bar.update(opt)
            if opt.local_epoch != last_epoch:
                self._report(public_key, loss_sum, mini_steps, contribution)
                if peer.save_steps and opt.local_epoch >= saved_step + peer.save_steps:
                    self._save_local(model, tokenizer)
                    saved_step = opt.local_epoch
                last_epoch, loss_sum, mini_steps = opt.local_epoch, 0.0, 0
                if peer.max_steps and opt.local_epoch >= peer.max_steps:
                    logger.info(f"Reached --max-steps {peer.max_steps}; stopping")
                    break
        bar.close()
        return 0

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
            path, meta = Path(peer.resume_from), ck.verify(peer.resume_from)
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
        logger.info(
            f"step {opt.local_epoch} | loss {mean:.4f} | averaged with {opt.last_group_size} peers | "
            f"{sps:.1f} samples/s | contribution {contribution} samples"
        )

    def close(self) -> None:
        if self.opt is not None:
            try:
                self.opt.shutdown()
            except Exception as e:
                logger.debug(f"optimizer shutdown: {e!r}")
        if self.dht is not None:
            self.dht.shutdown()
