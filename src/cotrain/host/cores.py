"""Several peers on one machine share its cores instead of oversubscribing them.

Left alone, every peer's torch takes all the machine's cores: two trainers on 2 cores run 4 busy OpenMP
threads, and each barrier of a forward/backward pass waits for a thread that is not running (two trainers
together made a third of one trainer's samples/s). ``CoreShare`` registers this peer in a per-user folder
(one file per live process), counts the live peers and gives torch ``max(1, cores // peers)`` threads; a
daemon thread re-counts every few seconds, so a peer started first drops to its share when a second one
starts and goes back up when it leaves. Files of processes that are gone are ignored (and removed).

torch's thread count belongs to the thread that calls ``torch.set_num_threads`` (OpenMP keeps it per
thread), so the watcher only computes the share: the training thread applies it, in ``start()`` and in
``apply()`` (called once per step; it costs a comparison unless the share changed). OMP_NUM_THREADS and
MKL_NUM_THREADS are read once at start-up, so they are not the way to change it while running.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

RECHECK_SECONDS = 3.0


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def share_of(cores: int, peers: int) -> int:
    """torch threads for one of ``peers`` peers on ``cores`` cores: an equal share, at least one."""
    return max(1, cores // max(1, peers))


def registry_folder() -> Path:
    """The per-user folder where the peers of this machine register: $XDG_RUNTIME_DIR/cotrain/peers, or
    /tmp/cotrain-UID/peers."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "cotrain" if runtime else Path(tempfile.gettempdir()) / f"cotrain-{os.getuid()}"
    return base / "peers"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" where /proc does not tell): a PID that was
    reused by a later process does not count as the peer that registered it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def _process_alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's (not in a per-user folder, but harmless)
    return not started or _start_time(pid) in ("", started)


class PeerRegistry:
    """One file per live peer process in ``folder``, named by its PID and holding its start time."""

    def __init__(self, folder: str | Path | None = None, pid: int | None = None) -> None:
        self.folder = Path(folder) if folder is not None else registry_folder()
        self.pid = pid if pid is not None else os.getpid()
        self.path = self.folder / str(self.pid)

    def register(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.folder.is_symlink() or self.folder.stat().st_uid != os.getuid():
            raise PermissionError(f"{self.folder} is not this user's own folder")
        tmp = self.folder / f".{self.pid}.tmp"
        tmp.write_text(_start_time(self.pid))
        os.replace(tmp, self.path)

    def unregister(self) -> None:
        self.path.unlink(missing_ok=True)

    def live(self) -> list[int]:
        """PIDs of the registered peers that are still running (this one included once registered); files
        of processes that are gone are removed."""
        pids = []
        try:
            entries = list(self.folder.iterdir())
        except OSError:
            return []
        for entry in entries:
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                started = entry.read_text().strip()
            except OSError:
                continue
            if _process_alive(pid, started):
                pids.append(pid)
            else:
                entry.unlink(missing_ok=True)
        return sorted(pids)


class CoreShare:
    """This peer's share of the machine's cores for torch, kept up to date while peers come and go.

    ``start()`` (from the training thread) registers the peer and sets torch's threads; ``apply()`` (from the
    same thread, once per step) follows the watcher's latest count; ``close()`` unregisters.
    """

    def __init__(
        self,
        folder: str | Path | None = None,
        cores: int | None = None,
        period: float = RECHECK_SECONDS,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        self.registry = PeerRegistry(folder)
        self.cores = cores if cores is not None else machine_cores()
        self.period = period
        self._set_threads = set_threads
        self.threads = 0  # the share the training thread runs with (0: not applied yet)
        self.wanted = self.cores  # the share the watcher computed last
        self.peers = 1
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> CoreShare:
        try:
            self.registry.register()
        except OSError as e:
            logger.warning(f"Not sharing the cores with other peers of this machine: {e}")
            return self
        self.recount()
        self.apply()
        self._watcher = threading.Thread(target=self._watch, name="core-share", daemon=True)
        self._watcher.start()
        return self

    def recount(self) -> int:
        """Count the live peers and compute this peer's share (any thread)."""
        live = self.registry.live()
        if self.registry.pid not in live and not self._stop.is_set():  # its file was removed by someone
            self.registry.register()
            live.append(self.registry.pid)
        self.peers = len(live)
        self.wanted = share_of(self.cores, self.peers)
        return self.wanted

    def apply(self) -> int:
        """Give torch this peer's current share (in the thread that runs the forward and backward passes)."""
        if self.wanted != self.threads:
            set_threads = self._set_threads
            if set_threads is None:
                import torch

                set_threads = torch.set_num_threads
            set_threads(self.wanted)
            logger.info(
                f"torch uses {self.wanted} of this machine's {self.cores} cores "
                f"({self.peers} peer(s) running here)"
            )
            self.threads = self.wanted
        return self.threads

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.recount()
            except Exception as e:  # a vanished folder, a full disk: keep the last share
                logger.debug(f"Counting this machine's peers failed: {e!r}")

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.period + 1)
            self._watcher = None
        self.registry.unregister()

    def __enter__(self) -> CoreShare:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
