"""cotrain: train language models collaboratively over the internet with hivemind.

``cotrain.SwarmPeer`` (see cotrain.engine.peer) joins a swarm from a training loop of one's own; it is
imported on first use, so that ``import cotrain`` (and the command line) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["SwarmPeer", "__version__"]

if TYPE_CHECKING:
    from cotrain.engine.peer import SwarmPeer  # deferred: `import cotrain` loads no torch


def __getattr__(name: str) -> Any:
    if name == "SwarmPeer":
        from cotrain.engine.peer import SwarmPeer  # deferred: `import cotrain` loads no torch

        return SwarmPeer
    raise AttributeError(f"module 'cotrain' has no attribute {name!r}")
