"""The engine: one swarm peer (``SwarmPeer``) that every face of cotrain builds on.

- ``join``: joining a swarm (validators, access control, the DHT, config agreement) for every role;
- ``Strategy`` (cotrain.strategies): how local gradients become the swarm's steps, the interface the
  engine asks;
- ``parts``: core sharing, healing, the NaN guard and fault injection, called at named points of a step;
- ``peer``: ``SwarmPeer``: catch up, step, report, heal, back up, checkpoint, shut down;
- ``compute``: a trainer's micro-steps (forward, backward, mixed precision) and its batches.
"""

from cotrain.engine.compute import accumulate_gradients, batches, gradient_norm
from cotrain.engine.join import SwarmConnection, take_swarm_run, take_swarm_settings
from cotrain.engine.peer import SwarmPeer
from cotrain.strategies.base import Strategy

__all__ = [
    "Strategy",
    "accumulate_gradients",
    "batches",
    "SwarmConnection",
    "SwarmPeer",
    "gradient_norm",
    "take_swarm_run",
    "take_swarm_settings",
]
