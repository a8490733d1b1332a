"""Adapters over hivemind's public API that take plain values (never cotrain's config, models or data).

- ``dht``: this process's DHT node with cotrain's defaults, clear errors, the visible addresses;
- ``metrics``, ``configrecord``, ``fingerprints``: the signed, schema-checked records peers publish
  (metrics and evaluations, the run config, fingerprints of the state) and their publishers;
- ``served``: who serves the training state, at which step;
- ``identity``, ``logs``: persistent peer ids; hivemind's expected network failures as one line;
- ``vouch``, ``reachability``, ``probe``: what an initial peer vouches for, whether others can dial this
  peer, why a private swarm refused it;
- ``healing``: re-joining after a partition.
"""

__all__ = [
    "configrecord",
    "dht",
    "fingerprints",
    "healing",
    "identity",
    "logs",
    "metrics",
    "probe",
    "reachability",
    "served",
    "vouch",
]
