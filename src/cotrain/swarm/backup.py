"""A NaN/inf guard for a trainer: an in-memory backup of its training state, restored when it goes non-finite.

Every ``--backup-every-steps`` global steps the trainer keeps a host-memory copy of the parameters and the
optimizer's state (LAMB/Adam moments). When a micro-batch's loss is NaN/inf and the parameters turn out to be
non-finite, or the parameters are non-finite right after a global step, the guard copies the backup back
(into the model, hivemind's offloaded optimizer and its averaging buffers), drops the gradients accumulated
since, and then, when other peers are training, loads the swarm's current state from them. The trainer keeps
training either way; it never sends non-finite gradients to the swarm (see the trainer loop).
"""

from __future__ import annotations

import copy
import logging

import torch

from cotrain.swarm.internals.hooks import load_local_tensors

logger = logging.getLogger(__name__)


def tensors_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _optimizer_parameters(averager) -> list[torch.Tensor]:
    return [p for group in averager.optimizer.param_groups for p in group["params"]]


class BackupGuard:
    """Backs up and restores the training state of one hivemind.Optimizer (see the module's doc)."""

    def __init__(self, opt, every: int):
        self.opt, self.every = opt, every
        self.step: int | None = None
        self.params: list[torch.Tensor] = []
        self.optimizer_state: dict | None = None
        self.restores = 0

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def parameters_finite(self) -> bool:
        averager = self.opt.state_averager
        with averager.lock_averaged_tensors:
            return tensors_finite(averager.main_parameters) and tensors_finite(
                _optimizer_parameters(averager)
            )

    def backup(self) -> None:
        """Copy the parameters and optimizer state to host memory (only when they are finite)."""
        averager = self.opt.state_averager
        with averager.lock_averaged_tensors:
            params = _optimizer_parameters(averager)
            if not tensors_finite(params):
                return
            self.params = [p.detach().to("cpu", copy=True) for p in params]
            self.optimizer_state = copy.deepcopy(averager.optimizer.state_dict())
            self.step = self.opt.local_epoch
        logger.debug(f"Backed up the training state of global step {self.step}")

    def after_global_step(self) -> bool:
        """Call after each global step: restore if the parameters went non-finite, else back up when due.
        Returns True if the state was restored."""
        if not self.enabled:
            return False
        if not self.parameters_finite():
            self.restore(f"non-finite parameters after global step {self.opt.local_epoch}")
            return True
        if self.step is None or self.opt.local_epoch >= self.step + self.every:
            self.backup()
        return False

    def after_bad_loss(self) -> bool:
        """Call when a micro-batch's loss is NaN/inf: restore if the parameters are the cause."""
        if not self.enabled or self.parameters_finite():
            return False
        self.restore("non-finite loss and parameters")
        return True

    def restore(self, reason: str) -> None:
        opt = self.opt
        averager = opt.state_averager
        if self.optimizer_state is None:
            logger.warning(f"{reason}: no backup yet; loading the swarm's state instead")
        else:
            with averager.lock_averaged_tensors, torch.no_grad():
                for saved, main, offloaded in zip(
                    self.params, averager.main_parameters, _optimizer_parameters(averager), strict=True
                ):
                    main.copy_(saved)
                    if offloaded is not main:
                        offloaded.copy_(saved)
                averager.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
            if not averager.reuse_tensors:
                load_local_tensors(averager)
            logger.warning(f"{reason}: restored the backup of global step {self.step}")
        self.restores += 1
        if opt.use_gradient_averaging:
            opt.grad_averager.reset_accumulated_grads_()
        opt.tracker.report_local_progress(local_epoch=opt.local_epoch, samples_accumulated=0)
        if opt.tracker.global_progress.num_peers > 1:
            logger.info("Loading the swarm's current state after the restore")
            opt.load_state_from_peers()
        if not self.parameters_finite():  # neither the backup nor the swarm: keep what is finite at least
            logger.error("The parameters are still not finite after restoring; training goes on regardless")
