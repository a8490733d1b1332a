"""Process hygiene without a swarm.

Here, with cotrain processes; the rest in tests/unit/host/test_procs.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import alive
from cotrain.host.procs import SUPERVISOR_ENV

# a worker: a child in its process group (as hivemind's DHT, averagers and p2pd are), a graceful stop when its
# supervisor is gone, then the exit that cotrain's worker makes
WORKER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from cotrain.host.procs import exit_worker, supervisor_pid
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


COPY_ON_WRITE = textwrap.dedent(
    """
    import gc, json, os, sys, time
    from cotrain._worker import share_pages_with_children

    def private_mb(pid):
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("Private_")) / 1024

    objects = [{"n": [i], "s": str(i)} for i in range(300_000)]  # a worker's long-lived objects
    if sys.argv[1] == "cotrain":
        share_pages_with_children()
    else:  # freezing for the fork only, as before
        os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # like an averager: it only waits
        os.read(read, 1)
        os._exit(0)
    time.sleep(0.5)
    before = private_mb(os.getpid()) + private_mb(child)
    gc.collect()  # a full collection in the parent, as CPython runs now and then
    after = private_mb(os.getpid()) + private_mb(child)
    os.write(write, b"x")
    os.waitpid(child, 0)
    print(json.dumps({"copied_mb": after - before}))
    """
)


@pytest.mark.parametrize("hook", ["cotrain", "unfreeze-after-fork"])
def test_a_full_collection_in_the_worker_copies_no_page_it_shares_with_its_children(hook):
    """The worker's objects stay frozen after it forks the DHT and the averagers: a full collection in the
    worker then writes to none of the pages it shares with them. Unfreezing them after the fork (the control)
    copies tens of MB at the worker's next full collection, which both processes then hold."""
    out = subprocess.run(
        [sys.executable, "-c", COPY_ON_WRITE, hook], capture_output=True, text=True, timeout=60, check=True
    )
    copied = json.loads(out.stdout.strip().splitlines()[-1])["copied_mb"]
    if hook == "cotrain":
        assert copied < 8, copied
    else:
        assert copied > 30, copied


def test_a_supervised_worker_gets_its_config_on_standard_input_and_no_file_is_left(tmp_path):
    # the supervisor hands the worker its resolved config through a pipe: nothing in the temporary folder,
    # at any moment, for a supervisor killed mid-run to leave behind (the worker still reads every setting)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    command = [sys.executable, "-m", "cotrain", "train", "--preset", "albert-tiny"]
    command += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--output-dir", str(tmp_path / "out")]
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: set[str] = set()
    while proc.poll() is None:
        seen.update(p.name for p in tmp.iterdir())
        time.sleep(0.02)
    out = proc.stdout.read()
    assert proc.returncode != 0 and "give one of --dataset-path" in out, out
    ours = {name for name in seen | {p.name for p in tmp.iterdir()} if name.startswith("cotrain")}
    assert not ours  # (Python's multiprocessing keeps a pymp-* folder of its own while it runs)
    assert (tmp_path / "out" / "config.toml").exists()  # written by the worker from the config it was handed
