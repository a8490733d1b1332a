"""Peers on one machine share its cores.

Here, with cotrain processes; the rest in tests/unit/host/test_cores.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from cotrain.host.cores import CoreShare, PeerRegistry


def exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_registry_counts_live_peers_only(tmp_path):
    folder = tmp_path / "peers"
    me = PeerRegistry(folder)
    me.register()
    assert (folder.stat().st_mode & 0o777) == 0o700 and me.path.name == str(os.getpid())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        PeerRegistry(folder, pid=sleeper.pid).register()
        gone = exited_pid()
        (folder / str(gone)).write_text("")  # a peer that died without unregistering
        (folder / "notes.txt").write_text("not a peer")
        assert me.live() == sorted([os.getpid(), sleeper.pid])
        assert not (folder / str(gone)).exists()  # stale files are cleaned up
        # a PID now used by another process than the registered one does not count
        (folder / str(sleeper.pid)).write_text("1")
        assert me.live() == [os.getpid()]
    finally:
        sleeper.kill()
        sleeper.wait()
    me.unregister()
    assert me.live() == [] and not me.path.exists()


def test_the_share_follows_peers_that_start_and_leave(tmp_path):
    folder = tmp_path / "peers"
    applied: list[int] = []
    share = CoreShare(folder, cores=4, period=0.1, set_threads=applied.append).start()
    try:
        assert applied == [4] and share.threads == 4
        share.apply()
        assert applied == [4]  # nothing changed: torch is not called again
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            PeerRegistry(folder, pid=other.pid).register()
            deadline = time.monotonic() + 5
            while share.wanted != 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert share.apply() == 2 and applied == [4, 2] and share.peers == 2
        finally:
            other.kill()
            other.wait()
        deadline = time.monotonic() + 5
        while share.wanted != 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert share.apply() == 4 and applied == [4, 2, 4]
    finally:
        share.close()
    assert not (folder / str(os.getpid())).exists()
