"""torch's shared-memory files (``/dev/shm/torch_<pid>_*``): hivemind shares tensors between a peer's
processes through them (torch's ``file_system`` strategy), and ``torch_shm_manager`` removes them once its
clients exit. A peer whose whole process tree is killed (SIGKILL, as tests and benchmarks do) kills the
manager too and leaves them behind, holding RAM."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import psutil

SHM = Path("/dev/shm")


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
