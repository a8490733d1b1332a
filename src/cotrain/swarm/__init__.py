"""Thin adapters over hivemind that take plain values (never cotrain's config, models, checkpoints or data):

- ``dht``, ``requestpipe``: starting this process's DHT node with cotrain's defaults, clear errors, the
  visible addresses; the pipe its requests take to the DHT process;
- ``keys``: every DHT key of a run, named from its run id in one place;
- ``records``, ``configrecord``: the signed, schema-checked records peers publish (metrics, evaluations, the
  run config) and their validators;
- ``state``: the swarm's state as ``cotrain status`` and the dashboard read it;
- ``optimizer``, ``averaging``, ``fixes``: hivemind.Optimizer and its averagers as cotrain configures them;
- ``healing``, ``backup``, ``served``: re-joining after a partition, the NaN guard, who serves the state;
- ``progress``, ``liveness``: the swarm's progress without the peers that are gone; a round that waits for
  peers that no longer answer ends within a matchmaking time;
- ``vouch``: the run config an initial peer's address vouches for, asked over libp2p;
- ``identity``, ``logs``: persistent peer ids; hivemind's expected network failures as one line.
"""
