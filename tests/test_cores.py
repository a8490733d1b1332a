"""Peers on one machine share its cores: the share, the registry of live peers, and the share following
peers that come and go."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cotrain.host.cores import CoreShare, PeerRegistry, share_of


def test_each_peer_gets_an_equal_share_and_at_least_one_thread():
    assert share_of(2, 1) == 2 and share_of(2, 2) == 1 and share_of(2, 3) == 1
    assert share_of(16, 3) == 5 and share_of(16, 4) == 4 and share_of(1, 1) == 1 and share_of(8, 0) == 8


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


def test_a_removed_own_file_is_registered_again(tmp_path):
    share = CoreShare(tmp_path / "peers", cores=2, period=60, set_threads=lambda n: None).start()
    try:
        share.registry.unregister()
        assert share.recount() == 2 and share.registry.path.exists()
    finally:
        share.close()


def test_a_folder_of_another_user_is_not_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    applied: list[int] = []
    share = CoreShare(tmp_path, cores=2, set_threads=applied.append).start()
    share.close()
    assert applied == [] and "Not sharing the cores" in caplog.text


@pytest.mark.timeout(60)
def test_torch_takes_the_share_in_the_thread_that_applies_it(tmp_path):
    import torch

    before = torch.get_num_threads()
    share = CoreShare(tmp_path / "peers", cores=1).start()
    try:
        assert torch.get_num_threads() == 1
    finally:
        share.close()
        torch.set_num_threads(before)
