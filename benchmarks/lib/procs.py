"""A role's process tree, process by process: what each process is (``kinds``), its memory (``sample``).

A role is the supervisor the user started (``python -m cotrain ROLE``), its worker (``-m cotrain._worker``),
the worker's forked children (hivemind's DHT, whose child is the libp2p daemon ``p2pd``, and the averagers),
and torch's ``torch_shm_manager`` where tensors are shared through /dev/shm. ``sample`` reads each process's
RSS, PSS and USS (psutil, from /proc/PID/smaps) and its PSS by what backs it (``pss_split``); ``growth``
compares the first and the last quarter of a series of samples.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import psutil

KINDS = ("supervisor", "worker", "dht", "p2pd", "averager", "torch_shm_manager", "other")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    name: str
    cmdline: tuple[str, ...]


def kinds(procs: list[Proc], root: int) -> dict[int, str]:
    """What each process of a role's tree is: the supervisor (``root``, ``python -m cotrain ROLE``), the
    worker (``-m cotrain._worker``), the worker's forked children (the same command line): the DHT is the one
    whose child is ``p2pd``, the others are averagers; then p2pd and torch's shm manager by name."""
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    out = {root: "supervisor"}
    workers = [p for p in children.get(root, []) if "cotrain._worker" in p.cmdline]
    for worker in workers:
        out[worker.pid] = "worker"
        for child in children.get(worker.pid, []):
            if child.name == "torch_shm_manager":
                out[child.pid] = "torch_shm_manager"
            elif child.cmdline == worker.cmdline:
                grandchildren = children.get(child.pid, [])
                out[child.pid] = "dht" if any(g.name == "p2pd" for g in grandchildren) else "averager"
    for p in procs:
        if p.name == "p2pd":
            out[p.pid] = "p2pd"
        out.setdefault(p.pid, "other")
    return out


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def sample(pid: int) -> list[dict]:
    """One sample of a role's tree: a row per process (MiB), with its kind."""
    rows, procs = [], []
    for p in tree(pid):
        try:
            with p.oneshot():
                info = Proc(p.pid, p.ppid(), p.name(), tuple(p.cmdline()))
                mem = p.memory_full_info()
        except psutil.Error:
            continue
        procs.append(info)
        rows.append({"pid": p.pid, "rss": mem.rss / 2**20, "pss": mem.pss / 2**20, "uss": mem.uss / 2**20,
                     **pss_split(p.pid)})  # fmt: skip
    kind = kinds(procs, pid)
    for row in rows:
        row["kind"] = kind[row["pid"]]
    return rows


def pss_split(pid: int) -> dict[str, float]:
    """A process's PSS by what backs it (MiB, from /proc/PID/smaps_rollup): ``pss_anon`` (its heap and
    anonymous mappings: allocator arenas, tensors), ``pss_file`` (libraries and other mapped files),
    ``pss_shmem`` (shared memory: tensors handed between processes through /dev/shm); empty where the kernel
    has no rollup."""
    fields = {"Pss_Anon:": "pss_anon", "Pss_File:": "pss_file", "Pss_Shmem:": "pss_shmem"}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in fields:
            out[fields[parts[0]]] = int(parts[1]) / 1024
    return out


def growth(values: list[float]) -> float:
    """Relative change from the mean of the first quarter of ``values`` to the mean of the last quarter."""
    quarter = max(1, len(values) // 4)
    first, last = statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])
    return (last - first) / first if first else 0.0
