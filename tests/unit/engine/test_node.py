"""A peer of several ranks (cotrain.engine.node).

Here, in the test process alone; the rest in tests/swarm/test_node.py (ranks as processes of the test)
and tests/live/test_node.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cotrain import config as cfg
from cotrain.config.fields import ConfigError
from cotrain.engine.node import check_shardable
from cotrain.errors import UserError
from support.node import tiny_llama


def test_what_a_node_refuses_before_any_rank_starts():
    model = tiny_llama()  # its largest parameters: the embeddings, 97 rows (a key projection has 16)
    check_shardable(model, 97)
    with pytest.raises(UserError, match="too small to shard over 98 ranks .*embed_tokens.* at most 97 ranks"):
        check_shardable(model, 98)
    with pytest.raises(ConfigError, match="trains with --strategy diloco"):
        cfg.resolve("llama-tiny", overrides={"peer": {"nproc_per_node": 2}})
    lamb = {"run": {"strategy": "diloco"}, "peer": {"nproc_per_node": 2, "fp16": True}}
    with pytest.raises(ConfigError, match="(?s)'lamb' cannot do.*not --fp16"):
        cfg.resolve("albert-tiny", overrides=lamb)
    ok = cfg.resolve("llama-tiny", overrides={"run": {"strategy": "diloco"}, "peer": {"nproc_per_node": 2}})
    assert ok.problems() == []


def test_the_ranks_meet_only_in_a_folder_closed_to_other_users(tmp_path, monkeypatch):
    """The store of a node's rendezvous is a file in a folder of this user's, mode 0700: a rank refuses a
    folder that another user could enter (who could then read the ranks' addresses and write their own)."""
    from cotrain.host.ranks import RENDEZVOUS, STORE_FILE, node_store, private_folder, rendezvous_problem

    folder = Path(private_folder())
    try:
        assert (folder.stat().st_mode & 0o777) == 0o700 and rendezvous_problem(str(folder)) is None
        monkeypatch.setenv(RENDEZVOUS, str(folder))
        first, second = node_store(2), node_store(2)  # two ranks' ends of the one store
        first.set("rank-1-address", "127.0.0.1:5000")
        assert second.get("rank-1-address") == b"127.0.0.1:5000"
        del first, second
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(shared)
    (tmp_path / "file").write_text("")
    cases = {shared: "other users may open it (mode drwxr-x---)", tmp_path / "link": "it is not a folder"}
    cases.update({tmp_path / "file": "it is not a folder", tmp_path / "none": "it cannot be opened"})
    for path, problem in cases.items():
        shared.chmod(0o750)
        assert problem in (rendezvous_problem(str(path)) or ""), path
        monkeypatch.setenv(RENDEZVOUS, str(path))
        with pytest.raises(UserError, match="cannot meet in their rendezvous folder") as e:
            node_store(2)
        assert problem in str(e.value) and not (shared / STORE_FILE).exists()
    if os.getuid() == 0:  # a folder of another user's, mode 0700: that user could read the store
        os.chown(shared, 65534, 65534)
        shared.chmod(0o700)
        assert rendezvous_problem(str(shared)) == "another user owns it"
    monkeypatch.delenv(RENDEZVOUS)
    with pytest.raises(UserError, match="none was given"):
        node_store(2)


def test_rank_zero_hands_its_ranks_the_rendezvous_in_their_environment_only(monkeypatch):
    """Rank 0 makes the private folder, gives its path to the ranks it starts in their environment (never on
    their command line, which every user of the machine can read) and removes it when the ranks are done."""
    import threading

    from cotrain.host import ranks as ranks_module

    started: list[tuple[list[str], dict]] = []

    class Started:
        def poll(self):
            return None

        def wait(self, timeout=None):
            return 0

    def start_worker(command, config, env):
        started.append((command, env))
        return Started()

    # Ranks sets rank 0's own variables in this process: set first, so that the test's end removes them
    # (a variable absent before is not restored by delenv alone, and would reach every later test's peers)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", ranks_module.RENDEZVOUS, *ranks_module.IFNAME_VARIABLES):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(ranks_module, "start_worker", start_worker)
    config = cfg.resolve(
        "llama-tiny", overrides={"run": {"strategy": "diloco"}, "peer": {"nproc_per_node": 3}}
    )
    node = ranks_module.Ranks(config, 3, threading.Event())
    folder = node.rendezvous
    try:
        assert ranks_module.rendezvous_problem(folder) is None
        assert [env["RANK"] for _, env in started] == ["1", "2"]
        for command, env in started:
            assert env[ranks_module.RENDEZVOUS] == folder and not any(folder in arg for arg in command)
        assert os.environ[ranks_module.RENDEZVOUS] == folder and os.environ["RANK"] == "0"  # rank 0's own
    finally:
        node.stopping()
        node.close(timeout=0.1)
    assert not os.path.exists(folder)
