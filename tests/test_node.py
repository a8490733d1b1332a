"""A peer of several ranks (cotrain.engine.node): the model sharded with FSDP2 over gloo ranks on the CPU.

- the node's step is the one-process step on the union of its ranks' micro-batches, and its gather and
  broadcast carry the parameters and the inner optimizer's state whole (two ranks, in-process, fast);
- a swarm of a 2-rank, a 2-rank and a 1-rank peer trains llama-tiny with DiLoCo: they average, the loss
  falls, and the 2-rank peer's checkpoint exports to the folder the 1-rank peer's export of the same round
  is, logits and all (live, slow);
- a rank that dies mid-step stops its peer with one line, and nothing of the peer is left running (live);
- what a node refuses, before any rank starts (tests/test_bad_input.py has the command-line rows).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    alive,
    events,
    monitor_address,
    monitor_args,
    trainer_rows,
    wait_until,
)
from cotrain import checkpoints as ck
from cotrain import config as cfg
from cotrain.config.fields import ConfigError
from cotrain.engine.node import check_shardable
from cotrain.errors import UserError

RUN = "node-swarm"


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


@pytest.fixture(scope="module")
def clm_data(tmp_path_factory) -> Path:
    from cotrain.data import prepare_from_source

    out = tmp_path_factory.mktemp("clm") / "data"
    prepare_from_source(
        demo=True, text_files=None, out_dir=out, max_length=64, vocab_size=2000, objective="clm"
    )
    return out


def node_trainer(data: Path, out: Path, seed: int, ranks: int, *extra: str, env: dict | None = None) -> Role:
    args = ["train", "--preset", "llama-tiny", "--max-seq-length", "64", "--run-id", RUN]
    args += ["--host-maddrs", LOCALHOST, *FAST, "--strategy", "diloco", "--local-steps", "4"]
    args += ["--target-batch-size", "128", "--per-device-train-batch-size", "4", "--devices", "cpu"]
    args += ["--nproc-per-node", str(ranks), "--dataset-path", str(data), "--seed", str(seed)]
    args += ["--output-dir", str(out / f"peer{seed}"), *extra]
    return Role(args, out / f"peer{seed}.log", env=env)


def tree_of(role: Role, ranks: int, timeout: float = 60) -> list[int]:
    """The processes of a running peer once all its ranks are up."""
    wait_until(lambda: len(role.tree()) >= 2 + ranks, timeout, what="the peer's ranks")
    return role.tree()


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(420)
def test_peers_of_two_ranks_and_one_rank_train_together_and_export_the_same_model(clm_data, tmp_path):
    import transformers

    # sparse rounds: every member applies the same decoded average, so their global parameters agree exactly
    common = ["--save-steps", "1", "--save-total-limit", "20"]
    # rounds of 512 samples: long beside a failed round's wait (matchmaking, then --averaging-timeout), so
    # that a peer whose first steps were slow meets the others at the next round's end
    common += ["--max-steps", "6", "--load-state-timeout", "30"]
    # a monitor that reduces nothing welcomes them, so that the three trainers start together
    run = ["--preset", "llama-tiny", "--max-seq-length", "64", "--run-id", RUN, "--host-maddrs", LOCALHOST]
    run += [*FAST, "--strategy", "diloco", "--local-steps", "4", "--target-batch-size", "128"]
    run += ["--outer-compression", "topk"]
    monitor = Role(
        monitor_args(run, tmp_path / "monitor", "--no-reduce", "--save-every", "0"), tmp_path / "monitor.log"
    )
    roles = [monitor]
    try:
        address = monitor_address(tmp_path / "monitor", 90)
        for seed, ranks in ((1, 2), (2, 2), (3, 1)):
            extra = [*common, "--outer-compression", "topk", "--initial-peers", *address]
            roles.append(node_trainer(clm_data, tmp_path, seed, ranks, *extra))
        trainers = zip(roles[1:], (2, 2, 1), strict=True)
        pids = sorted({pid for role, ranks in trainers for pid in tree_of(role, ranks)})
        for role in roles[1:]:
            role.proc.wait(timeout=300)
        assert [role.proc.returncode for role in roles[1:]] == [0, 0, 0], [r.text()[-2000:] for r in roles]
        time.sleep(1)
        assert alive(pids) == [], "a rank or a child of a peer outlived it"
    finally:
        for role in roles:
            if role.proc.poll() is None:
                role.kill_all()
    joined = [events(tmp_path / f"peer{seed}", "joined")[0] for seed in (1, 2, 3)]
    assert [j["micro_batch"] for j in joined] == [8, 8, 4], joined  # 4 per rank
    rows = {seed: trainer_rows(tmp_path / f"peer{seed}") for seed in (1, 2, 3)}
    uniform = math.log(2000)  # the loss of a uniform guess over the vocabulary
    for seed in (1, 2, 3):  # every peer averaged with others, and its loss fell, far below a uniform guess
        losses = [r["loss"] for r in rows[seed]]
        assert any(r["group_size"] >= 2 for r in rows[seed]), rows[seed]
        assert losses[-1] < losses[0] and losses[-1] < uniform - 1.2, losses
    together = {r["step"] for r in rows[1] if r["group_size"] >= 3} & {r["step"] for r in rows[3]}
    assert together, "the three peers never averaged in one group"
    # a round both saved, after which all three had averaged: the 2-rank peer's gathered global parameters
    # are the 1-rank peer's, and so are their exports
    saved = {p.name for p in (tmp_path / "peer1" / "checkpoints").iterdir()}
    shared = sorted(
        p
        for p in (tmp_path / "peer3" / "checkpoints").iterdir()
        if p.name in saved and int(p.name[5:]) >= min(together)
    )
    assert shared, (saved, together)
    step_dir = shared[0].name  # the first round all three averaged in
    exports = {}
    for seed in (1, 3):
        path = tmp_path / f"peer{seed}" / "checkpoints" / step_dir
        ck.verify(path)
        exports[seed] = ck.export(path, tmp_path / f"export{seed}")
    ids = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for seed, folder in exports.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logits[seed] = model(input_ids=ids).logits
    torch.testing.assert_close(logits[1], logits[3], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_dies_mid_step_stops_its_peer_with_one_line(clm_data, tmp_path):
    peer = node_trainer(clm_data, tmp_path, 1, 2, "--max-steps", "50", env={"COTRAIN_FAULT": "rank-exit:3"})
    try:
        pids = tree_of(peer, 2)
        peer.proc.wait(timeout=120)
    finally:
        if peer.proc.poll() is None:
            peer.kill_all()
    lines = [line for line in peer.text().splitlines() if line.strip()]
    assert peer.proc.returncode not in (0, None)
    assert "Traceback" not in peer.text(), peer.text()[-3000:]
    assert lines[-1].startswith("cotrain train: error: rank 1 of this peer stopped (exit code 3)"), lines[-3:]
    assert [line for line in lines if "error" in line.lower()] == [lines[-1]], lines
    time.sleep(1)
    assert alive(pids) == [], "a rank or a child of the peer outlived it"
