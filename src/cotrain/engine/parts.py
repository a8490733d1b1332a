"""The parts of a peer that ``SwarmPeer.step`` calls at named points, each installed only where it is enabled:
core sharing (several peers on one machine), healing (re-joining after a partition), the NaN guard (a
backup restored when the parameters turn non-finite) and fault injection (the tests' and benchmarks' hooks,
switched on by environment variables: cotrain.faults).

The points of a step, in order:
- ``before_step(peer)``: before the gradients of a micro-batch are looked at;
- ``outgoing(peer, samples)``: a finite micro-batch goes to the strategy; returns the samples to report;
- ``dropped(peer, loss_ok)``: a micro-batch was dropped (non-finite gradients, or a non-finite loss);
- ``after_global_step(peer)``: the swarm took a global step, before the metrics record is published;
- ``close()``: the peer shuts down.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from cotrain.engine.backup import BackupGuard
from cotrain.faults import Attack, Faults
from cotrain.host.cores import CoreShare
from cotrain.net.healing import SwarmHealer

logger = logging.getLogger(__name__)

__all__ = ["CoreSharing", "FaultInjection", "Healing", "NanGuard", "Part", "Stepping"]


class Stepping(Protocol):
    """What the parts read of the peer whose step calls them (cotrain.engine.peer.SwarmPeer)."""

    strategy: Any
    trained_tensors: list[Any]

    @property
    def global_step(self) -> int: ...

    def adopt_swarm_state(self, floor: int = 0) -> None: ...


class Part:
    """A part of a peer: every point a no-op unless the part needs it."""

    def before_step(self, peer: Stepping) -> None:
        pass

    def outgoing(self, peer: Stepping, samples: int) -> int:
        return samples

    def dropped(self, peer: Stepping, loss_ok: bool) -> None:
        pass

    def after_global_step(self, peer: Stepping) -> None:
        pass

    def close(self) -> None:
        pass


class CoreSharing(Part):
    """Peers of one machine share its cores (cotrain.host.cores): before each step, follow the current
    share."""

    def __init__(self) -> None:

        self.share = CoreShare().start()

    def before_step(self, peer: Stepping) -> None:
        self.share.apply()  # another peer of this machine started or left: follow the new share

    def close(self) -> None:
        self.share.close()


class Healing(Part):
    """Watches the peer's links to the swarm and, back from a partition, adopts the swarm's state before the
    next step (cotrain.net.healing)."""

    def __init__(self, dht: Any, initial_peers: list[str], stop: threading.Event, strategy: Any) -> None:

        self.healer = SwarmHealer(dht, initial_peers, stop, strategy)
        self.healer.start()

    @property
    def rejoins(self) -> int:
        return self.healer.rejoins

    def before_step(self, peer: Stepping) -> None:
        if self.healer.resync.is_set():
            self.healer.resync.clear()
            peer.adopt_swarm_state(self.healer.epoch_when_isolated)

    def close(self) -> None:
        self.healer.close()


class NanGuard(Part):
    """A backup of the training state every ``every`` global steps, restored when the parameters turn
    non-finite (cotrain.engine.backup)."""

    def __init__(self, strategy: Any, every: int) -> None:

        self.guard = BackupGuard(strategy, every)
        self.guard.after_global_step()  # the first backup: the state this peer starts from

    def dropped(self, peer: Stepping, loss_ok: bool) -> None:
        if not loss_ok:
            self.guard.after_bad_loss()  # restores the backup when the parameters are the cause

    def after_global_step(self, peer: Stepping) -> None:
        self.guard.after_global_step()  # non-finite parameters: restore the backup; else back up when due


class FaultInjection(Part):
    """The fault hooks of the tests and benchmarks (cotrain.faults): a NaN gradient or NaN parameters at a
    given step, and a malicious peer's gradients and claimed samples (COTRAIN_ATTACK)."""

    def __init__(self, faults: Any, attack: Any) -> None:
        self.faults, self.attack = faults, attack

    @classmethod
    def from_env(cls, strategy: str) -> FaultInjection | None:
        """The part when the environment asks for a fault, else None."""

        faults, attack = Faults(), Attack.from_env(strategy)
        if faults.active or attack.name:
            return cls(faults, attack)
        return None

    def before_step(self, peer: Stepping) -> None:
        self.faults.poison_gradients(peer.trained_tensors, peer.global_step)

    def outgoing(self, peer: Stepping, samples: int) -> int:
        # an attacker's gradient goes on the wire past the peer's own checks
        return self.attack.before_step(peer.trained_tensors, samples)

    def after_global_step(self, peer: Stepping) -> None:
        with peer.strategy.training_state() as (optimizer, _, params):
            targets = [params[0], optimizer.param_groups[0]["params"][0]]
            self.faults.corrupt_parameters(targets, peer.global_step)
