"""The monitor as an auxiliary reducer: trainers that cannot be dialed (client mode) average through it."""

from __future__ import annotations

import pytest
import torch
from hivemind.optim.progress_tracker import GlobalTrainingProgress

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    monitor_address,
    monitor_args,
    trainer_args,
    trainer_rows,
    wait_until,
)
from cotrain.swarm.auxiliary import AUX_GATHER, contributors, is_auxiliary, needed
from cotrain.swarm.robust import RecordParts
from cotrain.swarm.sparse import TopK


def _progress(peers: int, clients: int) -> GlobalTrainingProgress:
    return GlobalTrainingProgress(
        epoch=3,
        samples_accumulated=0,
        target_batch_size=64,
        num_peers=peers,
        num_clients=clients,
        eta_next_epoch=0.0,
        next_fetch_time=0.0,
    )


def test_a_reducer_counts_for_nobody_and_serves_only_swarms_with_clients():
    gathered = {"a": None, "b": {"lineage": b"x", "round": 2}, "aux": dict(AUX_GATHER)}
    assert contributors(gathered) == 2
    assert is_auxiliary(AUX_GATHER) and not is_auxiliary(None) and not is_auxiliary({"auxiliary": 1})
    # two trainers, one a client: needed; full peers reduce for each other; one trainer averages with nobody
    assert needed(_progress(2, 1)) and needed(_progress(3, 3))
    assert not needed(_progress(3, 0)) and not needed(_progress(1, 1))


def test_an_auxiliary_reducer_carries_what_its_records_left_out_into_its_next_average():
    codec = TopK(density=1 / 64, bits=2)
    n = codec.chunk * 2
    records = torch.zeros(codec.encoded_size(n), dtype=torch.uint8)
    part = records[: codec.record]  # the part of the first chunk
    average = torch.randn(codec.chunk, generator=torch.Generator().manual_seed(0))

    trainer = RecordParts([codec], [part], [records], torch.zeros(n))
    trainer.reduced(0, average, senders=3)
    decoded = codec.decode(codec.encode(average))
    # a trainer keeps the residual times its senders: it sends it in its next round, whose average divides it
    assert torch.allclose(trainer.feedback[: codec.chunk], (average - decoded) * 3, atol=1e-6)

    aux = RecordParts([codec], [part], [records], torch.zeros(n), carry=True)
    first = codec.decode(aux.reduced(0, average, senders=3))
    assert torch.allclose(first, decoded) and torch.allclose(aux.feedback[: codec.chunk], average - decoded)
    # the next average it reduces of the same values takes in what the first one left out
    second = codec.decode(aux.reduced(0, torch.zeros(codec.chunk), senders=3))
    assert torch.allclose(second, codec.decode(codec.encode(average - decoded)))
    sent = first + second + aux.feedback[: codec.chunk]
    assert torch.allclose(sent, average, atol=1e-6)  # nothing is lost: sent, or still kept
    assert aux.feedback[codec.chunk :].abs().sum() == 0  # the other chunk was not this part's


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_two_client_trainers_average_through_the_monitor(strategy, demo_data, tmp_path):
    """Two trainers in client mode and no other full peer: only the monitor can reduce their parts."""
    common = ["--preset", "albert-tiny", "--run-id", f"aux-{strategy}", "--host-maddrs", LOCALHOST, *FAST]
    common += ["--strategy", strategy]
    if strategy == "diloco":  # sparse rounds: the reducer decodes, averages and re-encodes the records
        common += ["--local-steps", "2", "--outer-compression", "topk"]
    steps = 6
    monitor = Role(
        monitor_args(common, tmp_path / "monitor", "--dataset-path", str(demo_data), "--save-every", "0"),
        tmp_path / "monitor.log",
    )
    roles = [monitor]
    try:
        initial = monitor_address(tmp_path / "monitor", 90)
        for i in range(2):
            args = trainer_args(common, initial, demo_data, i + 1, tmp_path / f"t{i}", "--client-mode")
            roles.append(Role([*args, "--max-steps", str(steps)], tmp_path / f"trainer{i}.log"))
        for trainer in roles[1:]:
            wait_until(lambda t=trainer: t.proc.poll() is not None, 300, what="the trainers to finish")
            assert trainer.proc.returncode == 0, trainer.text()[-3000:]
    finally:
        for role in roles:
            role.stop()
    text = monitor.log_path.read_text()
    assert "Reducing the trainers'" in text and "as an auxiliary peer" in text, text[-3000:]
    reduced = int(text.split("Reduced ", 1)[1].split()[0])  # its last line: rounds it took part in
    rows = [trainer_rows(t) for t in roles[1:]]
    together = [{r["step"] for r in rs if r["group_size"] == 2} for rs in rows]
    # clients cannot reduce for each other: every step they averaged together went through the monitor,
    # which counts for no one in the group's size
    assert len(together[0] & together[1]) >= steps // 2, rows
    assert reduced >= len(together[0] & together[1]), text[-3000:]
    assert all(r["group_size"] <= 2 for rs in rows for r in rs), rows
    for rs in rows:
        assert rs[-1]["step"] >= steps and rs[-1]["loss"] < rs[0]["loss"], rs
    for trainer in roles[1:]:
        assert "Traceback" not in trainer.log_path.read_text()
    assert "Traceback" not in text
