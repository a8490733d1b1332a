"""The evaluation peer: every ``--eval-every`` seconds it loads the swarm's latest state from its peers,
measures it on fixed held-out batches and publishes the result as a signed record that the monitor logs.

It never contributes gradients and never serves state: its DHT node runs in client mode and its copy of the
state lives in the same ``TrainingStateAverager`` the monitor keeps checkpoints with (``StateKeeper``), filled
by hivemind's ``load_state_from_peers`` and never offered to others. The batches are drawn once, at start-up,
from the dataset's validation split with the peer's ``--seed`` (examples and masks alike), so successive
evaluations are comparable.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from cotrain import checkpoints as ck
from cotrain import faults, models
from cotrain.config import Config
from cotrain.data import ExampleStream, tokenizer_hash
from cotrain.engine.join import SwarmConnection, take_swarm_settings
from cotrain.errors import UserError
from cotrain.models import collator_for_run, model_for_tokenizer
from cotrain.net.metrics import MAX_PERPLEXITY, EvalMetrics, publish_evaluation
from cotrain.net.served import served_epochs
from cotrain.roles.keeper import StateKeeper, inner_parts

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


def fixed_batches(data, collator, num_batches: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """The first ``num_batches x batch_size`` examples of ``data`` (an ExampleStream: its order depends only
    on its seed), collated once. Fewer when the split is smaller; every example at most once."""
    wanted = min(num_batches * batch_size, data.num_examples)
    stream = iter(data)
    examples = [next(stream) for _ in range(wanted)]
    return [collator(examples[i : i + batch_size]) for i in range(0, len(examples), batch_size)]


def model_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The columns of ``batch`` that a cotrain model family takes; any other model gets the whole batch."""

    try:
        return models.model_inputs(model, batch)
    except (KeyError, AttributeError):
        return batch


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]], objective: str) -> dict:
    """Held-out metrics of ``model`` on ``batches``.

    ``loss``: the mean over batches of the model's own training loss (ALBERT: masked LM + sentence order),
    the number comparable with the trainers' loss; ``lm_loss``: the language-modelling loss per predicted
    token over all batches, and ``perplexity`` its exponential; ``mlm_accuracy`` (masked objectives): the
    share of masked tokens predicted exactly; ``sop_accuracy`` (ALBERT): the share of sentence pairs whose
    order is right."""
    if not batches:
        raise ValueError("no evaluation batches")
    was_training = model.training
    model.eval()
    try:
        loss_sum, lm_sum, tokens, correct, sop_right, examples = 0.0, 0.0, 0, 0, 0, 0
        for batch in batches:
            out = model(**model_inputs(model, batch))
            loss_sum += float(out.loss)
            labels = batch["labels"]
            logits = out.prediction_logits if hasattr(out, "prediction_logits") else out.logits
            if objective == "clm":  # the model predicts token t+1 at position t
                logits, labels = logits[:, :-1], labels[:, 1:]
            mask = labels != IGNORE_INDEX
            picked, targets = logits[mask].float(), labels[mask]
            lm_sum += float(F.cross_entropy(picked, targets, reduction="sum"))
            tokens += int(mask.sum())
            correct += int((picked.argmax(-1) == targets).sum())
            if "sentence_order_label" in batch:
                sop_right += int((out.sop_logits.argmax(-1) == batch["sentence_order_label"]).sum())
            examples += len(labels)
    finally:
        model.train(was_training)
    lm_loss = lm_sum / tokens if tokens else 0.0
    return {
        "loss": loss_sum / len(batches),
        "lm_loss": lm_loss,
        "perplexity": min(math.exp(min(lm_loss, 700.0)), MAX_PERPLEXITY),
        "mlm_accuracy": correct / tokens if tokens and objective != "clm" else None,
        "sop_accuracy": sop_right / examples if objective == "sop+mlm" else None,
        "examples": examples,
        "tokens": tokens,
    }


class Evaluator:
    def __init__(self, config: Config, stop: threading.Event):
        self.config = config
        self.stop = stop
        self.dht = None
        self.connection = None
        self.keeper = None
        self.last_step = -1

    def run(self) -> int:

        peer = self.config.peer
        source = peer.dataset_url or peer.dataset_path
        if not source or (peer.dataset_url and peer.dataset_path):
            raise UserError(
                "give one of --dataset-path (a folder made by `cotrain prepare`) or --dataset-url (the URL "
                "of one on an HTTP server): its validation split is what the evaluation peer measures"
            )
        # a client: it only downloads state and writes its record, so it never needs to be reachable; a
        # private swarm: it stops with one line when its token is refused (expired, revoked)
        self.connection = connection = SwarmConnection(
            self.config.run.run_id, peer, role="eval", client_mode=True, stop=self.stop
        )
        self.dht = connection.dht
        take_swarm_settings(connection, self.config)  # only an address: the swarm's settings
        run = self.config.run
        if peer.torch_threads:
            torch.set_num_threads(peer.torch_threads)
        with ExampleStream(
            source, seed=peer.seed, cache_dir=peer.cache_dir or None, split="validation"
        ) as data:
            if data.objective != run.objective:
                raise UserError(
                    f"dataset {source} was prepared for {data.objective!r}, "
                    f"but preset {run.preset} trains {run.objective!r}"
                )
            tokenizer = data.tokenizer
            collator = collator_for_run(run, tokenizer, seed=peer.seed)
            batches = fixed_batches(data, collator, peer.eval_batches, peer.per_device_eval_batch_size)
        # measuring another model than the swarm's would be meaningless: refuse a differing config (it only
        # reads the swarm's config records and publishes none: it is not one of the run's trainers)
        connection.agree(run, tokenizer_hash(tokenizer), publish=False)
        public_key = connection.public_key

        self.keeper = StateKeeper(
            self.dht,
            self.config,
            tokenizer,
            Path(peer.output_dir) / "evaluated",
            self.stop,
            model=model_for_tokenizer(run, tokenizer),
        )
        logger.info(
            f"Evaluation peer {self.dht.peer_id} joined run {run.run_id!r}: "
            f"{sum(len(b['labels']) for b in batches)} held-out examples in {len(batches)} batches, "
            f"every {peer.eval_every:g} s"
        )
        while not self.stop.is_set():
            started = time.monotonic()
            served = served_epochs(self.dht, run.run_id)  # peers serving state, by their global step
            if not served:
                logger.info("No peer serves the swarm's state yet; waiting")
            elif max(served.values()) <= self.last_step:  # nothing new: no download
                logger.info(f"No state newer than global step {self.last_step} yet")
            elif self._load():
                self._evaluate(batches, tokenizer, public_key)
            self.stop.wait(max(0.0, peer.eval_every - (time.monotonic() - started)))
        if connection.refusal:
            raise UserError(connection.refusal)
        return 0

    def _load(self) -> bool:
        """Download the swarm's latest state; True when it is one not evaluated yet."""
        averager, timeout = self.keeper.averager, self.config.peer.load_state_timeout
        try:
            averager.load_state_from_peers(timeout=timeout)
        except Exception as e:  # a slow or vanished peer: try again at the next evaluation
            logger.warning(f"Loading the swarm's state failed ({type(e).__name__}: {e}); retrying later")
            return False
        if averager.local_epoch <= self.last_step:
            logger.info(f"No state newer than global step {self.last_step} yet")
            return False
        return True

    def _evaluate(self, batches: list[dict], tokenizer, public_key: bytes) -> None:
        run, peer = self.config.run, self.config.peer
        averager, model = self.keeper.averager, self.keeper.model
        started = time.monotonic()
        with averager.lock_averaged_tensors:
            step = averager.local_epoch
            result = evaluate(model, batches, run.objective)
            if faults.enabled(faults.SAVE_EVALUATED):  # tests recompute the metrics from the very weights
                self._save(step, tokenizer)
        self.last_step = step
        try:
            record = EvalMetrics(step=step, time=time.time(), peer_id=str(self.dht.peer_id)[:128], **result)
        except ValueError:
            logger.warning(f"Not publishing the evaluation of step {step}: values out of bounds ({result})")
            return
        publish_evaluation(self.dht, run.run_id, public_key, record, peer.statistics_expiration)
        extra = "".join(
            f" | {name} {result[name]:.4f}"
            for name in ("mlm_accuracy", "sop_accuracy")
            if result[name] is not None
        )
        logger.info(
            f"eval step {step} | loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f}{extra} | "
            f"{result['examples']} examples in {time.monotonic() - started:.1f} s"
        )

    def _save(self, step: int, tokenizer) -> None:

        averager = self.keeper.averager
        ck.save_checkpoint(
            Path(self.config.peer.output_dir) / "evaluated",
            step,
            self.keeper.model,
            averager.optimizer,
            averager.scheduler,
            self.config.to_dict(),
            tokenizer,
            keep=1000,
            source="eval",
            params=averager.main_parameters,
            inner=inner_parts(averager),
        )

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.shutdown()
        if self.connection is not None:
            self.connection.close()
