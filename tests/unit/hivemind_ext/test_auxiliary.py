"""The monitor as an auxiliary reducer.

Here, in the test process alone; the rest in tests/live/test_auxiliary.py and
tests/swarm/test_auxiliary.py."""

from __future__ import annotations

import torch
from hivemind.optim.progress_tracker import GlobalTrainingProgress

from cotrain.algorithms.sparse import TopK
from cotrain.hivemind_ext.auxiliary import AUX_GATHER, contributors, is_auxiliary, needed, round_to_reduce
from cotrain.hivemind_ext.reducers import RecordParts


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


def test_a_reducer_serves_the_round_most_trainers_are_in_not_a_lone_leaders():
    assert round_to_reduce([]) is None
    assert round_to_reduce([7]) == 7
    # two clients a round behind a lone leader: their round, where a group of two can form
    assert round_to_reduce([5, 4, 4]) == 4
    assert round_to_reduce([5, 5, 4]) == 5
    # as many in each: the latest (a lone trainer behind will join it: it averages with nobody where it is)
    assert round_to_reduce([3, 4]) == 4 and round_to_reduce([6, 6, 5, 5, 2]) == 6


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
