"""torch's shared-memory files left by killed peers (cotrain.host.shm): removed once their process is gone,
kept while another process maps them (torch aborts a process that frees a storage whose file is gone); a
peer's processes share tensors by file descriptors instead, with no manager process and no files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cotrain.host.shm import SHM, remove_leftovers

CODE = r"""
import gc, glob, os, sys, time
import torch, torch.multiprocessing as mp
from cotrain.host.shm import remove_leftovers

def child(q):
    q.put(torch.zeros(1000).share_memory_())
    time.sleep(0.5)

if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    kept = q.get()  # this process maps the child's file
    p.join()
    files = glob.glob(f"/dev/shm/torch_{p.pid}_*")
    assert files, "no shared-memory file"
    assert remove_leftovers([p.pid]) == 0 and all(os.path.exists(f) for f in files)  # still mapped here
    del kept
    gc.collect()  # torch unlinks the file itself: this process survives
    print("ok", flush=True)
"""


@pytest.mark.slow  # several seconds: the full suite runs it, not the daily "not slow" run
@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_a_file_still_mapped_is_kept_and_a_dead_processs_file_removed(tmp_path):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    # a file of a process that is gone, mapped by none: removed
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(done.stdout)
    orphan = SHM / f"torch_{pid}_1_0"
    orphan.write_bytes(b"x")
    assert remove_leftovers([pid]) == 1 and not orphan.exists()


DESCRIPTORS = r"""
import glob, os, resource
import psutil, torch, torch.multiprocessing as mp
import cotrain.net.dht  # imports hivemind, which asks for files in /dev/shm
from cotrain.host.shm import share_by_descriptors

def child(shared, q, received):
    shared += 1  # the parent sees it
    q.put(torch.arange(5.0).share_memory_())  # and a tensor made here crosses back (the sender must live
    received.wait(60)  # until the receiver took its descriptor, as hivemind's averager processes do)

if __name__ == "__main__":
    assert share_by_descriptors() == (os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY") is None)
    shared = torch.zeros(5).share_memory_()
    ctx = mp.get_context("fork")  # as hivemind forks its DHT and averagers
    q, received = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=child, args=(shared, q, received))
    p.start()
    got = q.get(timeout=60)
    received.set()
    p.join()
    assert shared.tolist() == [1.0] * 5 and got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    managers = [c for c in psutil.Process().children(recursive=True) if c.name() == "torch_shm_manager"]
    files = glob.glob(f"/dev/shm/torch_{os.getpid()}_*") + glob.glob(f"/dev/shm/torch_{p.pid}_*")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(len(managers), len(files), soft == hard or hard == resource.RLIM_INFINITY)
"""


@pytest.mark.slow  # several seconds: the full suite runs it, not the daily "not slow" run
@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
@pytest.mark.parametrize("users_choice", [None, "file_system"])
def test_a_peers_processes_share_tensors_with_no_manager_and_no_files(users_choice):
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    if users_choice:
        env["HIVEMIND_MEMORY_SHARING_STRATEGY"] = users_choice
    out = subprocess.run(
        [sys.executable, "-c", DESCRIPTORS], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    managers, files, raised = out.stdout.split()
    if users_choice is None:
        assert (managers, files, raised) == ("0", "0", "True")
    else:  # the user's own choice is kept: hivemind's files, and torch's manager that removes them
        assert managers == "1" and int(files) >= 1


def test_too_few_open_files_keep_hivemind_files():
    code = (
        "import resource, torch.multiprocessing as mp, cotrain.net.dht\n"
        "from cotrain.host.shm import share_by_descriptors\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))\n"
        "print(share_by_descriptors(), mp.get_sharing_strategy())"
    )
    env = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "file_system"]
