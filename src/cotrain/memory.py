"""Give freed heap memory back to the operating system, now and then, in every process of a peer.

glibc's malloc keeps the memory a process freed for its next allocations. After a rare peak (the monitor
downloading and saving the swarm's state, a trainer catching up, an all-reduce of a larger state) a
long-lived process then holds that peak for the rest of its run: an hour's memory of a peer rises in steps
that never come down. ``malloc_trim(0)`` hands every whole free page of every arena back (measured on the
tiny ALBERT: 14 ms for a worker's heap, and the next step runs a few tens of ms slower while it takes back
what it needs), so each process of a peer calls it once a minute, from a daemon thread: the process that
starts the peer's DHT and every process forked from it afterwards (the DHT's, the averagers'). Elsewhere
than on glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time

TRIM_EVERY = 60.0  # seconds

_libc = None
_lock = threading.Lock()
_trimmer_pid: int | None = None  # the process whose trimming thread runs
_hooked = False


def _malloc_trim():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc: musl, macOS
            _libc = False
    return _libc.malloc_trim if _libc else None


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the operating system; return whether any were."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def _trim_forever(every: float) -> None:
    while True:
        time.sleep(every)
        release_free_memory()


def _start_thread(every: float) -> None:
    global _trimmer_pid
    with _lock:
        if _trimmer_pid == os.getpid():
            return
        _trimmer_pid = os.getpid()
    threading.Thread(target=_trim_forever, args=(every,), name="cotrain-trim", daemon=True).start()


def keep_heap_trimmed(every: float = TRIM_EVERY) -> None:
    """Trim this process's heap every ``every`` seconds, and that of every process forked from it from now
    on (a forked child has no threads but the one that forked: it starts its own). Calling it again does
    nothing."""
    global _hooked
    if _malloc_trim() is None:
        return
    _start_thread(every)
    if not _hooked:
        _hooked = True
        os.register_at_fork(after_in_child=lambda: _start_thread(every))
