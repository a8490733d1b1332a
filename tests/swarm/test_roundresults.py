"""A round's result served to a peer that missed the round (cotrain.hivemind_ext.roundresults): round
averagers of DHTs on 127.0.0.1 in the test's process (each serving from a process of its own, as hivemind's
averagers do), one result kept by each donor."""

from __future__ import annotations

import hivemind
import pytest
import torch
from hivemind.compression import NoCompression

from cotrain.algorithms.aggregation import Mean
from cotrain.algorithms.sparse import TopK
from cotrain.hivemind_ext.outer import round_averager
from cotrain.hivemind_ext.roundresults import RoundResult

BEFORE, AFTER = b"lineage0", b"lineage1"


@pytest.fixture
def swarm():
    made: list = []

    def averager(numel: int = 1000):
        initial = made[0][0].get_visible_maddrs() if made else []
        dht = hivemind.DHT(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial, nat_port_map=False, start=True
        )
        averager = round_averager(
            [torch.zeros(numel)],
            dht,
            run_id="results-test",
            codec=TopK(),
            compression=NoCompression(),
            aggregation=Mean(),
            matchmaking_time=2.0,
            request_timeout=1.0,
            averaging_timeout=10.0,
            averager_opts={},
        )
        made.append((dht, averager))
        return dht, averager

    yield averager
    for dht, averager in reversed(made):
        averager.shutdown()
        dht.shutdown()


def records(averager, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    with averager.get_tensors() as tensors:
        shapes = [(t.shape, t.dtype) for t in tensors[: averager.changes]]
    return tuple(torch.randint(0, 256, s, dtype=d, generator=generator) for s, d in shapes)


@pytest.mark.timeout(120)
def test_a_round_result_is_served_whole_to_its_lineage_checked_and_refused_where_donors_disagree(swarm):
    """A donor serves the result it kept to a peer of the round's lineage, exactly; a round or a lineage it
    keeps none of gets nothing; a second donor must serve the same digest (a liar beside an honest donor
    makes the peer take neither); a donor whose tensors are not the round's shapes is refused."""
    (a, kept), (b, other), (_, asker) = swarm(), swarm(), swarm()
    honest = records(kept, 0)
    kept.keep_result(RoundResult(5, BEFORE, AFTER, honest))
    donor = [a.peer_id.to_bytes()]
    got = asker.fetch_result(donor, 5, BEFORE, timeout=10.0)
    assert got is not None and got.after == AFTER and got.round == 5
    assert all(torch.equal(x, y) for x, y in zip(got.tensors, honest, strict=True))
    assert asker.fetch_result(donor, 6, BEFORE, timeout=10.0) is None  # a round it keeps nothing of
    assert asker.fetch_result(donor, 5, b"lineageX", timeout=10.0) is None  # another lineage's

    # two donors that agree: taken; one that serves another result beside them: neither is taken
    other.keep_result(RoundResult(5, BEFORE, AFTER, honest))
    both = [a.peer_id.to_bytes(), b.peer_id.to_bytes()]
    assert asker.fetch_result(both, 5, BEFORE, timeout=10.0) is not None
    other.keep_result(RoundResult(7, BEFORE, AFTER, records(other, 1)))
    kept.keep_result(RoundResult(7, BEFORE, AFTER, honest))
    assert asker.fetch_result(both, 7, BEFORE, timeout=10.0) is None

    # a donor whose round averager holds tensors of another size: what it serves does not fit, and is refused
    d, misshaped = swarm(numel=20000)
    misshaped.keep_result(RoundResult(5, BEFORE, AFTER, records(misshaped, 2)))
    assert asker.fetch_result([d.peer_id.to_bytes()], 5, BEFORE, timeout=10.0) is None
