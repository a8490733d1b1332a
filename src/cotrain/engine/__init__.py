"""The engine: one swarm peer (``SwarmPeer``) that every face of cotrain builds on.

- ``join``: joining a swarm (validators, access control, the DHT, config agreement) for every role;
- ``strategy``: how local gradients become the swarm's steps (``sync`` today), a part of the peer;
- ``peer``: ``SwarmPeer``: catch up, step, report, heal, back up, checkpoint, shut down;
- ``compute``: a trainer's micro-steps (forward, backward, mixed precision) and its batches.
"""

from cotrain.engine.compute import accumulate_gradients, batches, gradient_norm
from cotrain.engine.join import SwarmConnection, take_swarm_run, take_swarm_settings
from cotrain.engine.peer import SwarmPeer
from cotrain.engine.strategy import STRATEGIES, SyncStrategy

__all__ = [
    "STRATEGIES",
    "accumulate_gradients",
    "batches",
    "SwarmConnection",
    "SwarmPeer",
    "SyncStrategy",
    "gradient_norm",
    "take_swarm_run",
    "take_swarm_settings",
]
