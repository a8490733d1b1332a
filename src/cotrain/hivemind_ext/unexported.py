"""hivemind names that cotrain uses outside this package but that no hivemind package exports (the public API
is listed in cotrain.hivemind_ext.manifest.PUBLIC): code elsewhere imports them from here, so that each one
is named once and a move upstream breaks one import.

- ``Multiaddr``: a libp2p address, as hivemind's P2P takes and returns them (hivemind.utils.multiaddr);
- ``ControlFailure``: the error of a request the p2pd daemon refused (its bindings' utils);
- ``AllreduceException``: the error hivemind raises for a failed part of an all-reduce (averaging.partition);
- ``LocalTrainingProgress``: the schema of a peer's progress record in the DHT (optim.progress_tracker).
"""

from __future__ import annotations

from hivemind.averaging.partition import AllreduceException
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.multiaddr import Multiaddr

__all__ = ["AllreduceException", "ControlFailure", "LocalTrainingProgress", "Multiaddr"]
