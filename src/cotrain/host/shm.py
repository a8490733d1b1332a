"""Shared memory between a peer's processes (its worker, hivemind's DHT and averager processes).

hivemind shares tensors through files in /dev/shm (``/dev/shm/torch_<pid>_*``, torch's ``file_system``
strategy), which ``torch_shm_manager`` removes once its clients exit; a peer whose whole process tree is
killed (SIGKILL, as tests and benchmarks do) kills the manager too and leaves them behind, holding RAM:
``remove_leftovers`` deletes those. cotrain's peers share by file descriptors instead where they can
(``share_by_descriptors``): no manager, no files."""

from __future__ import annotations

import os
import resource
from collections.abc import Collection
from pathlib import Path

import psutil

SHM = Path("/dev/shm")
MIN_DESCRIPTORS = 16384  # open files a peer may hold, at least, to share tensors by descriptors


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def mapped_files() -> set[str]:
    """The names of torch's shared-memory files that some process still maps."""
    names = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "maps").read_text(errors="replace")
        except OSError:
            continue
        names.update(line.rsplit("/", 1)[-1] for line in text.splitlines() if "/dev/shm/torch_" in line)
    return names


def remove_leftovers(pids: Collection[int] | None = None, since: float | None = None) -> int:
    """Remove the files of processes that are gone (of ``pids`` only, if given; made at or after ``since``,
    if given) and that no process maps: torch aborts a process that frees a storage whose file is gone.
    Returns how many were removed."""
    if not SHM.is_dir():
        return 0
    wanted = None if pids is None else set(pids)
    mapped = mapped_files()
    removed = 0
    for path in SHM.glob("torch_*_*"):
        try:
            pid = int(path.name.split("_")[1])
            if wanted is not None and pid not in wanted:
                continue
            if path.name in mapped or not _gone(pid):
                continue
            if since is not None and path.stat().st_mtime < since:
                continue
            path.unlink()
            removed += 1
        except (ValueError, OSError):
            continue
    return removed


def share_by_descriptors(min_descriptors: int = MIN_DESCRIPTORS) -> bool:
    """Share tensors between this process and those it forks as anonymous shared memory held by file
    descriptors (torch's ``file_descriptor`` strategy) instead of hivemind's files in /dev/shm: no
    ``torch_shm_manager`` process per peer (about 56 MB of memory each: libtorch's operator tables, built
    when it starts) and nothing left in /dev/shm by a peer that is killed. Each shared tensor keeps a
    descriptor open in every process of the peer (a large model's state is thousands of tensors), so the
    soft limit on open files is raised to the hard one, and where that stays under ``min_descriptors``,
    hivemind's files are kept. So is a user's own choice (``HIVEMIND_MEMORY_SHARING_STRATEGY``). A process
    that sends a tensor to another must live until the other has taken its descriptor (hivemind's averager
    processes do). Call it after hivemind is imported, before any tensor is shared. Returns whether
    descriptors are used."""
    import torch.multiprocessing as mp  # only here: the rest of this module needs no torch

    if os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY"):
        return False
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < min_descriptors:
        return False
    mp.set_sharing_strategy("file_descriptor")
    return True
