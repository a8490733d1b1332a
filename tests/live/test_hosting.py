"""A peer's DHT and averagers served from threads of its process (cotrain.hivemind_ext.hosting), or from
processes of their own (``--swarm-processes``).

Here, with cotrain processes; the rest in tests/swarm/test_hosting.py and
tests/unit/hivemind_ext/test_hosting.py."""

from __future__ import annotations

import time

import pytest

STOPPING_AT_EXIT = """
import sys, threading, time, torch
from cotrain.hivemind_ext import hosting
hosting.EXIT_GRACE_S = float(sys.argv[2])
a = torch.randn(1500, 1500)
stop, started = threading.Event(), threading.Event()
def work():  # long pieces of tensor work, a stop looked at between them (an all-reduce's part, a fingerprint)
    started.set()
    while not stop.is_set():
        for _ in range(20):
            a.add_(1.0).mul_(0.999)
def stuck():  # never looks
    while True:
        time.sleep(0.05)
thread = threading.Thread(target=stuck if sys.argv[1] == "stuck" else work, daemon=True)
thread.start()
started.wait(1.0)
time.sleep(0.3)
if sys.argv[1] == "finalized":  # a peer left running: its finalizer stops the thread at exit
    import weakref
    class Peer:
        pass
    peer = Peer()
    weakref.finalize(peer, lambda: (stop.set(), hosting.join_at_exit(thread)))
else:
    stop.set()
    if sys.argv[1] != "left":
        hosting.join_at_exit(thread)
print("exiting", time.time(), flush=True)
sys.exit(0)
"""


def _exit_of(kind: str, grace: float = 15.0) -> tuple[int, str, float]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STOPPING_AT_EXIT, kind, str(grace)], capture_output=True, text=True, timeout=60
    )
    ended = time.time()
    exiting = [line.split() for line in done.stdout.splitlines() if line.startswith("exiting")]
    assert exiting, done.stderr[-2000:]
    # from the moment the script began to exit (its imports, slow on a loaded machine, do not count)
    return done.returncode, done.stderr, ended - float(exiting[0][1])


@pytest.mark.slow
def test_a_thread_asked_to_stop_finishes_its_tensor_work_before_the_process_exits():
    # left to Python, a daemon thread inside a torch operation at exit aborts the whole process
    aborts = []
    for _ in range(3):
        rc, err, _ = _exit_of("left")
        aborts.append(rc != 0 and "terminate called without an active exception" in err)
        if aborts[-1]:
            break
    assert any(aborts), "a daemon thread in tensor work at exit no longer aborts the process"
    # given to join_at_exit, it ends its piece of work and the process exits cleanly: when its peer was shut
    # down before the exit, and when the peer's own finalizer shuts it down at the exit
    for kind in ("joined", "finalized"):
        rc, err, _ = _exit_of(kind)
        assert rc == 0, (kind, err[-2000:])
    # and a thread that never ends holds the exit up for the grace period only
    rc, err, took = _exit_of("stuck", grace=1.0)
    assert rc == 0, err[-2000:]
    assert took < 10, took
