"""The monitor's copy of the swarm's training state: loaded from peers every N global steps, saved to disk as
a checkpoint, and served to newcomers, so a swarm whose trainers all left resumes from it.

The state lives in the run's strategy's state holder (for sync, a hivemind ``TrainingStateAverager`` with
the same prefix, parameters, optimizer and schedule as the trainers' ``hivemind.Optimizer`` uses,
``{run_id}_state_averager``; for diloco, the global parameters with the outer and inner optimizers):
hivemind's own
``load_state_from_peers`` fills it, and hivemind's own state sharing serves it, with priority = the saved
global step (trainers that are further along are asked first). The averager is created in the main thread
(hivemind requires it); downloads and saves run in a worker thread of their own, so a slow download never
stalls the monitor's metrics loop or its dashboard. A failed download is logged and retried later.

The monitor holds the state in the run model's parameters without the model's code (``cotrain.host.layout``:
it never computes, and transformers' model code would cost its process about 100 MB), and the run's tokenizer
as its saved files (``cotrain.host.layout.SavedTokenizer``); the evaluation peer, which computes with it,
passes its model. Nor does the monitor import torch.compile's tracer (cotrain.host.nocompile).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import hivemind
import torch

from cotrain import checkpoints as ck
from cotrain import hivemind_ext as internals
from cotrain.config import Config
from cotrain.errors import UserError
from cotrain.hivemind_ext.hooks import load_local_tensors
from cotrain.host.layout import LayoutModel
from cotrain.host.nocompile import keep_dynamo_out
from cotrain.registry import strategy_class

logger = logging.getLogger(__name__)

RETRY_SECONDS = 10.0  # after a failed download, wait at least this long (or for a newer step) before the next


def inner_parts(averager: Any) -> tuple | None:
    """DiLoCo's inner (optimizer, scheduler) that a state holder carries, for its checkpoints."""
    if not hasattr(averager, "inner_optimizer"):
        return None
    return averager.inner_optimizer, averager.inner_scheduler


class StateKeeper:
    """Holds, checkpoints and serves the swarm's state for the monitor."""

    def __init__(
        self,
        dht: hivemind.DHT,
        config: Config,
        tokenizer: Any,
        root: str | Path,
        stop: threading.Event,
        model: torch.nn.Module,
    ) -> None:
        """``model``: the model to hold the state in: the run model's parameters without its code for the
        monitor, which never computes (a cotrain.host.layout.LayoutModel, from run_state_layout), the real
        model for the evaluation peer, which computes with it. ``tokenizer``: a loaded tokenizer, or its
        saved files (cotrain.host.layout.SavedTokenizer)."""
        run, peer = config.run, config.peer
        self.config, self.tokenizer, self.root, self.stop = config, tokenizer, Path(root), stop
        internals.install()
        if isinstance(model, LayoutModel):  # the monitor computes nothing: no torch.compile tracer either
            keep_dynamo_out()
        self.model = model
        # the strategy's state: sync's optimizer and schedule, or diloco's global parameters, outer
        # momentum and inner optimizer (cotrain.strategies.base)
        self.averager = strategy_class(run.strategy).state_holder(dht, run, peer, self.model)
        self.saved_step = -1
        self.global_step = -1
        self.final_wanted = False  # trainers are leaving: their final state is due now
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # --- resume ---------------------------------------------------------------------------------

    def resume(self) -> int | None:
        """Load the newest good checkpoint under root (bad ones are skipped with a log line) and serve it."""
        found = ck.latest_good(self.root)
        if found is None:
            logger.info(f"No good checkpoint in {self.root}: waiting for the trainers' state instead")
            return None
        path, meta = found
        if meta.get("tokenizer_hash") != ck.content_hash(self.tokenizer):
            raise UserError(f"checkpoint {path} was made with another tokenizer than this run's")
        averager = self.averager
        with averager.lock_averaged_tensors:
            ck.load_into(
                path,
                self.model,
                averager.optimizer,
                averager.scheduler,
                meta=meta,
                params=averager.main_parameters,
                inner=inner_parts(averager),
            )
            averager.local_epoch = int(meta["step"])
        if not averager.reuse_tensors:
            load_local_tensors(averager)
        self.saved_step = int(meta["step"])
        self._serve()
        logger.info(f"Resumed from checkpoint {path} (global step {self.saved_step}); serving it to peers")
        return self.saved_step

    # --- the worker -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, daemon=True, name="state-keeper")
        self._thread.start()

    def notice_step(self, step: int) -> None:
        """Called by the metrics loop with the swarm's global step; never blocks."""
        if step > self.global_step:
            self.global_step = step
            self._wake.set()

    def notice_leaving(self) -> None:
        """Called when trainers announce they are done: checkpoint their final state now, whatever
        --save-every says, while they still serve it."""
        if self.global_step > self.saved_step and not self.final_wanted:
            logger.info(
                f"Trainers are leaving: checkpointing their final state (global step ~{self.global_step})"
            )
            self.final_wanted = True
            self._wake.set()

    def _due(self) -> bool:
        every = self.config.peer.save_every
        if self.final_wanted and self.global_step > self.saved_step:
            return True
        return self.global_step > 0 and self.global_step >= max(self.saved_step, 0) + every

    def _keep(self) -> None:
        while not self.stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self.stop.is_set() or not self._due():
                continue
            try:
                loaded = self.fetch_and_save()
            except Exception as e:  # never kills the monitor
                logger.warning(f"Checkpoint failed ({type(e).__name__}: {e}); retrying later")
                loaded = False
            if not loaded:
                self.stop.wait(RETRY_SECONDS)

    def fetch_and_save(self) -> bool:
        """Download the swarm's state and save it. Returns whether a newer state was saved."""
        timeout = self.config.peer.load_state_timeout
        logger.info(f"Loading the swarm's state at global step ~{self.global_step} for a checkpoint")
        started = time.monotonic()
        try:
            self.averager.load_state_from_peers(timeout=timeout)
        except TimeoutError:
            logger.warning(f"Loading the swarm's state took over {timeout:.0f} s; retrying later")
            return False
        step = self.averager.local_epoch
        if step <= self.saved_step:
            logger.info(f"No peer served a state newer than step {self.saved_step}; retrying later")
            return False
        with self.averager.lock_averaged_tensors:
            path = ck.save_checkpoint(
                self.root,
                step,
                self.model,
                self.averager.optimizer,
                self.averager.scheduler,
                self.config.to_dict(),
                self.tokenizer,
                keep=self.config.peer.keep_checkpoints,
                source="monitor",
                params=self.averager.main_parameters,
                inner=inner_parts(self.averager),
            )
        self.saved_step = step
        if step >= self.global_step:
            self.final_wanted = False
        self._serve()
        logger.info(f"Saved checkpoint {path} (global step {step}) in {time.monotonic() - started:.1f} s")
        return True

    def _serve(self) -> None:
        self.averager.state_sharing_priority = self.saved_step
        self.averager.allow_state_sharing = True

    def shutdown(self) -> None:
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.averager.shutdown()
        except Exception as e:
            logger.debug(f"state averager shutdown: {e!r}")
