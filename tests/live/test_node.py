"""A peer of several ranks (cotrain.engine.node).

Here, with cotrain processes; the rest in tests/unit/engine/test_node.py and tests/swarm/test_node.py."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

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

RUN = "node-swarm"


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
@pytest.mark.timeout(240)
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
