"""Process hygiene without a swarm: a worker whose supervisor is SIGKILLed takes its process group with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import alive
from cotrain.procs import SUPERVISOR_ENV

# a worker: a child in its process group (as hivemind's DHT, averagers and p2pd are), a graceful stop when its
# supervisor is gone, then the exit that cotrain's worker makes
WORKER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from cotrain.procs import exit_worker, supervisor_pid
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(os.getpid(), child.pid, flush=True)
    while os.getppid() == supervisor_pid():
        time.sleep(0.1)
    exit_worker(0, supervisor_pid())
    """
)
# the supervisor: starts the worker in a session of its own with its PID in the environment, then waits
SUPERVISOR = textwrap.dedent(
    f"""
    import os, subprocess, sys
    env = dict(os.environ, {SUPERVISOR_ENV}=str(os.getpid()))
    worker = subprocess.Popen([sys.executable, "-c", {WORKER!r}], env=env, start_new_session=True)
    worker.wait()
    """
)


@pytest.mark.timeout(60)
def test_a_worker_whose_supervisor_is_killed_leaves_no_process_of_its_group():
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True)
    pids = [supervisor.pid]
    try:
        worker, child = (int(pid) for pid in supervisor.stdout.readline().split())
        pids += [worker, child]
        assert os.getpgid(child) == worker  # the child is in the worker's group, as hivemind's are
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=5)
        deadline = time.monotonic() + 15
        while alive([worker, child]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive([worker, child])
    finally:
        for pid in alive(pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
