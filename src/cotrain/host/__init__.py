"""What a peer needs of the machine it runs on, beside the domain: its processes, memory, cores and devices.

- ``procs``: every role as a thin supervisor plus a worker in its own process group;
- ``cores``: several peers on one machine share its cores instead of oversubscribing them;
- ``hardware``: where and how a trainer computes (devices, mixed precision, the automatic micro-batch size);
- ``shm``: shared memory between a peer's processes;
- ``layout``: a model's layout without its code (the monitor's copy of the parameters);
- ``nocompile``: torch.compile's tracer kept out of a process that never compiles;
- ``deferred``: modules a process imports only when it first uses them.
"""

__all__ = ["cores", "deferred", "hardware", "layout", "nocompile", "procs", "shm"]
