"""A peer of several ranks (cotrain.engine.node).

Here, in the test process alone; the rest in tests/live/test_node.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from cotrain import config as cfg
from cotrain.config.fields import ConfigError
from cotrain.engine.node import check_shardable
from cotrain.errors import UserError


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, num_key_value_heads=2, **shape))


def batch_of(rank: int, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(100 * step + rank))
    return {"input_ids": ids, "labels": ids}


def _rank_main(rank: int, world: int, steps: int, rendezvous: str) -> None:
    """One rank of the in-process check (spawned): rank 0 drives, checks and raises on a mismatch."""
    import torch.distributed as dist

    from cotrain.engine.node import Node
    from cotrain.host.hardware import Precision
    from cotrain.host.ranks import RENDEZVOUS, init_ranks
    from cotrain.models import forward_loss
    from cotrain.optim import parameter_groups

    # the private rendezvous, as cotrain's own launch has it
    os.environ.update({RENDEZVOUS: rendezvous, "RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(1)
    init_ranks(torch.device("cpu"))
    adamw = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)  # noqa: E731
    node = Node(tiny_llama(), lambda m: parameter_groups(m, 0.1), adamw, torch.device("cpu"))
    stream = (batch_of(rank, step) for step in range(10**6))
    precision = Precision(torch.device("cpu"))
    if rank:
        node.follow(stream, 1, precision, forward_loss)
        dist.destroy_process_group()
        return
    replica, reference = tiny_llama(), tiny_llama()
    replica_opt = node.inner_optimizer(adamw)(parameter_groups(replica, 0.1))
    node.attach(replica)
    ref_opt = adamw(parameter_groups(reference, 0.1))
    for step in range(steps):
        loss = node.accumulate(stream, 1, precision, forward_loss)
        norm = node.gradient_norm(1.0)
        replica_opt.step()  # the node's step, at the replica's learning rates
        replica_opt.zero_grad()
        # the same step in one process: the mean of the ranks' losses, clipped alike
        losses = [forward_loss(reference, batch_of(r, step)) for r in range(world)]
        ref_loss = sum(losses) / world
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss - ref_loss.item()) < 1e-5 and abs(norm - ref_norm.item()) < 1e-4, (loss, norm)
    node.pull()
    named = dict(replica.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(named[name], param, atol=1e-5, rtol=1e-4, msg=name)
        ours, theirs = replica_opt.state[named[name]], ref_opt.state[param]
        torch.testing.assert_close(ours["exp_avg"], theirs["exp_avg"], atol=1e-6, rtol=1e-4, msg=name)
        assert int(ours["step"]) == steps
    with torch.no_grad():  # what rank 0 sends is what every rank then holds
        for param in replica.parameters():
            param.mul_(0.5)
        for state in replica_opt.state.values():
            state["exp_avg"].fill_(0.25)
    sent = {name: p.detach().clone() for name, p in replica.named_parameters()}
    node.push()
    with torch.no_grad():
        for param in replica.parameters():
            param.zero_()
    replica_opt.state.clear()
    node.pull()
    for name, param in replica.named_parameters():
        torch.testing.assert_close(param, sent[name], msg=name)
        assert bool((replica_opt.state[param]["exp_avg"] == 0.25).all()), name
    node.stop()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_node_step_is_the_one_process_step_and_its_state_moves_whole():
    from cotrain.host.ranks import private_folder

    rendezvous = private_folder()
    try:
        mp.spawn(_rank_main, args=(2, 3, rendezvous), nprocs=2, join=True)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


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
