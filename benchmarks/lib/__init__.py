"""What the benchmark scripts share. A script run as ``python benchmarks/X.py`` has its folder on
``sys.path``, so it imports these as ``from lib import netns``.

- ``netns``: hosts in network namespaces joined by a shaped bridge, home routers with NAT, the peer processes
  in them and the benchmarks' start and end lines;
- ``simulated``: simulated trainers on those hosts (its peer process and the swarm that runs them), for
  ``utilization.py``, ``traffic.py`` and ``aux_load.py``;
- ``roles``: cotrain's own roles as processes on 127.0.0.1, their metrics and the datasets they train on;
- ``procs``: a role's process tree, what each process is and its memory;
- ``steps``: training steps of a preset's model in fresh processes, arms side by side.
"""

__all__ = ["netns", "procs", "roles", "simulated", "steps"]
