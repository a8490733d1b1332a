"""The unit suite starts no process: a test here that does (a `cotrain` role, a libp2p daemon, a child
interpreter, a forked worker) fails, naming it; such a test belongs in tests/swarm or tests/live."""

from __future__ import annotations

import multiprocessing.util
import os
import subprocess

import pytest

# what a library the code uses runs once on its own: matplotlib lists the machine's fonts with fontconfig the
# first time it draws where no font cache exists yet
LIBRARY_TOOLS = {"fc-list"}


@pytest.fixture(autouse=True)
def no_process(monkeypatch):
    started: list[str] = []
    popen_init, fork, spawn = subprocess.Popen.__init__, os.fork, multiprocessing.util.spawnv_passfds

    def popen(self, args, *rest, **kwargs):
        if not (isinstance(args, (list, tuple)) and args and args[0] in LIBRARY_TOOLS):
            started.append(str(args)[:120])
        return popen_init(self, args, *rest, **kwargs)

    def forked():
        started.append("os.fork()")
        return fork()

    def spawned(path, args, passfds):  # multiprocessing's spawn and forkserver (torch.multiprocessing.spawn)
        started.append(f"multiprocessing: {str(args)[:100]}")
        return spawn(path, args, passfds)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawned)
    monkeypatch.setattr(os, "fork", forked)
    yield
    assert not started, f"a unit test started a process: {started}"
