"""Thin adapters over hivemind that take plain values (never cotrain's config, models, checkpoints or data),
and the swarm algorithms cotrain owns. Nothing here uses a private hivemind name: those live in ``internals``.

Adapters over hivemind:
- ``dht``: starting this process's DHT node with cotrain's defaults, clear errors, the visible addresses;
- ``keys``: every DHT key of a run, named from its run id in one place;
- ``records``, ``configrecord``: the signed, schema-checked records peers publish (metrics, evaluations, the
  run config) and their validators;
- ``state``, ``served``: the swarm's state as ``cotrain status`` and the dashboard read it; who serves the
  training state, at which step;
- ``optimizer``, ``averaging``: hivemind.Optimizer and its gradient averager as cotrain configures them;
- ``identity``, ``logs``: persistent peer ids; hivemind's expected network failures as one line.

Algorithms cotrain owns:
- ``diloco``, ``diloco_state``, ``lineage``: DiLoCo's rounds, its served state and outer optimizer, and the
  lineages that decide when a round also averages the outer state;
- ``robust``, ``direct``: robust aggregation of all-reduce parts; the direct TCP path the parts travel on;
- ``statecheck``, ``fingerprint``, ``statelimit``: a downloaded state checked against the fingerprints peers
  publish, and the size a donor may send;
- ``healing``, ``backup``: re-joining after a partition; the NaN guard;
- ``progress``, ``liveness``: the swarm's progress without the peers that are gone; a round that waits for
  peers that no longer answer ends within a matchmaking time;
- ``vouch``: the run config an initial peer's address vouches for, asked over libp2p.

The door to hivemind's internals: ``internals`` (its own docstring lists what it holds).
"""

__all__ = [
    "averaging",
    "backup",
    "configrecord",
    "dht",
    "diloco",
    "diloco_state",
    "direct",
    "fingerprint",
    "healing",
    "identity",
    "internals",
    "keys",
    "lineage",
    "liveness",
    "logs",
    "optimizer",
    "progress",
    "records",
    "robust",
    "served",
    "state",
    "statecheck",
    "statelimit",
    "vouch",
]
