"""A NaN/inf guard for a trainer: an in-memory backup of its training state, restored when it goes non-finite.

Every ``--backup-every-steps`` global steps the trainer keeps a host-memory copy of the parameters and the
optimizer's state (LAMB/Adam moments). When a micro-batch's loss is NaN/inf and the parameters turn out to be
non-finite, or the parameters are non-finite right after a global step, the guard copies the backup back
(into the model, the optimizer's copy of the parameters and the strategy's averaging buffers), drops the
gradients accumulated since, and then, when other peers are training, loads the swarm's current state from
them. The trainer keeps training either way; it never sends non-finite gradients to the swarm (see the
trainer loop).

A strategy whose training state only ever moves by steps checked finite (``state_is_backup``: DiLoCo, whose
global parameters change only by outer steps on finite averages, and by downloads, which are refused when not
finite: cotrain.hivemind_ext.statecheck) is its own backup: the guard keeps no copy (4 bytes per parameter of
host memory, 8 with outer momentum) and restores the model from that state, training its round again. Where
that state itself is not finite (corrupted in memory), the guard loads the swarm's instead; a lone peer then
has nothing to restore.
"""

from __future__ import annotations

import copy
import logging

import torch

logger = logging.getLogger(__name__)


def tensors_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class BackupGuard:
    """Backs up and restores the training state of one training strategy (cotrain.strategies.base.Strategy:
    its ``training_state()``, ``state_replaced()``, ``global_step``, ``num_peers`` and
    ``load_state_from_peers()``; see the module's doc)."""

    def __init__(self, strategy, every: int):
        self.strategy, self.every = strategy, every
        self.step: int | None = None
        self.params: list[torch.Tensor] = []
        self.optimizer_state: dict | None = None
        self.restores = 0

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def parameters_finite(self) -> bool:
        if self.strategy.state_is_backup:  # that state only moves by finite steps: the model is what fails
            return tensors_finite(self.strategy.model_parameters())
        with self.strategy.training_state() as (optimizer, _, params):
            return tensors_finite(params) and tensors_finite(_optimizer_parameters(optimizer))

    def backup(self) -> None:
        """Copy the parameters and optimizer state to host memory (only when they are finite; where the state
        is its own backup, only note the step)."""
        with self.strategy.training_state() as (optimizer, _, _params):
            params = _optimizer_parameters(optimizer)
            if not tensors_finite(params):
                return
            if not self.strategy.state_is_backup:
                self.params = [p.detach().to("cpu", copy=True) for p in params]
                self.optimizer_state = copy.deepcopy(optimizer.state_dict())
            self.step = self.strategy.global_step
        logger.debug(f"Backed up the training state of global step {self.step}")

    def after_global_step(self) -> bool:
        """Call after each global step: restore if the parameters went non-finite, else back up when due.
        Returns True if the state was restored."""
        if not self.enabled:
            return False
        if not self.parameters_finite():
            self.restore(f"non-finite parameters after global step {self.strategy.global_step}")
            return True
        if self.step is None or self.strategy.global_step >= self.step + self.every:
            self.backup()
        return False

    def after_bad_loss(self) -> bool:
        """Call when a micro-batch's loss is NaN/inf: restore if the parameters are the cause."""
        if not self.enabled or self.parameters_finite():
            return False
        self.restore("non-finite loss and parameters")
        return True

    def restore(self, reason: str) -> None:
        strategy = self.strategy
        if strategy.state_is_backup:  # one step old at most: the swarm's state is not downloaded
            if strategy.restore_from_state():
                logger.warning(f"{reason}: restored the training state of global step {strategy.global_step}")
                self.restores += 1
            else:
                logger.warning(f"{reason}: the training state is not finite either; loading the swarm's")
                strategy.load_state_from_peers()
            return
        if self.optimizer_state is None:
            logger.warning(f"{reason}: no backup yet; loading the swarm's state instead")
        else:
            with strategy.training_state() as (optimizer, _, main_parameters), torch.no_grad():
                for saved, main, offloaded in zip(
                    self.params, main_parameters, _optimizer_parameters(optimizer), strict=True
                ):
                    main.copy_(saved)
                    if offloaded is not main:
                        offloaded.copy_(saved)
                optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
            logger.warning(f"{reason}: restored the backup of global step {self.step}")
        strategy.state_replaced()
        self.restores += 1
        if strategy.progress.num_peers > 1:
            logger.info("Loading the swarm's current state after the restore")
            strategy.load_state_from_peers()
