"""Peers on one machine share its cores.

Here, in the test process alone; the rest in tests/live/test_cores.py."""

from __future__ import annotations

import os

import pytest

from cotrain.host.cores import CoreShare, share_of


def test_each_peer_gets_an_equal_share_and_at_least_one_thread():
    assert share_of(2, 1) == 2 and share_of(2, 2) == 1 and share_of(2, 3) == 1
    assert share_of(16, 3) == 5 and share_of(16, 4) == 4 and share_of(1, 1) == 1 and share_of(8, 0) == 8


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
