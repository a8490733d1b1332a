"""torch's shared-memory files left by killed peers (cotrain.shm): removed once their process is gone, kept
while another process maps them (torch aborts a process that frees a storage whose file is gone)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cotrain.shm import SHM, remove_leftovers

CODE = r"""
import gc, glob, os, sys, time
import torch, torch.multiprocessing as mp
from cotrain.shm import remove_leftovers

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
