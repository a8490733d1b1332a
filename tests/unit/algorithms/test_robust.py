"""Robust aggregation (cotrain.hivemind_ext.reducers).

Here, in the test process alone; the rest in tests/swarm/test_robust.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from cotrain import registry
from cotrain.algorithms.aggregation import (
    Aggregation,
    CenteredClip,
    Mean,
    build,
    capped_weights,
    centered_clip,
    parse_tau,
)
from cotrain.config import RunConfig
from cotrain.hivemind_ext import reducers as robust
from cotrain.hivemind_ext.reducers import RobustPartReducer
from cotrain.strategies.builds import aggregation_of


def test_without_outliers_centered_clip_is_the_weighted_mean():
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(6, 2000, generator=gen)
    weights = torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 2.0])
    result, distance, tau = centered_clip(parts, weights, None, iterations=20)
    mean = (weights @ parts) / weights.sum()
    torch.testing.assert_close(result, mean, atol=1e-5, rtol=0)
    assert (distance < 1).all() and tau > 0
    # a radius larger than every distance: the mean after one iteration, whatever the start
    result, _, _ = centered_clip(parts, weights, tau=1e6, iterations=1)
    torch.testing.assert_close(result, mean, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [1e3, 1e6, 1e12])
def test_one_outlier_of_any_size_moves_the_result_a_bounded_distance(size):
    gen = torch.Generator().manual_seed(1)
    honest = torch.randn(4, 1000, generator=gen) + 3.0
    mean = honest.mean(0)
    attack = -size * mean  # a sign flip, scaled
    parts = torch.cat([honest, attack[None]])
    weights = torch.ones(5)
    for tau in (None, 10.0):
        iterations = 5
        result, distance, used = centered_clip(parts, weights, tau, iterations)
        # each iteration moves the result by at most the outlier's share of tau, plus the honest pull
        assert (result - mean).norm() <= iterations * used / 5 + (honest - mean).norm(dim=1).max()
        assert distance[-1] > 2  # the outlier lies far outside tau
        assert torch.isfinite(result).all()
    plain = (weights @ parts) / weights.sum()
    assert (plain - mean).norm() > 100 * (result - mean).norm()  # the mean is wrecked, the clip is not


def test_a_claimed_huge_weight_buys_no_more_than_an_honest_share():
    weights = torch.tensor([32.0, 24.0, 40.0, 1e6])
    assert capped_weights(weights).tolist() == [32.0, 24.0, 32.0, 32.0]


def test_the_aggregation_settings_are_checked():
    assert parse_tau("auto") is None and parse_tau("0.5") == 0.5 and parse_tau(2) == 2.0
    with pytest.raises(ValueError, match="positive"):
        parse_tau("-1")
    with pytest.raises(ValueError, match="unknown aggregation 'median'; choose one of: mean, centered-clip"):
        build("median")
    with pytest.raises(ValueError, match="iterations"):
        build("centered-clip", iterations=0)
    run = RunConfig(aggregation="trimmed", clip_tau="zero", clip_iterations=0)
    text = " ".join(run.problems())
    assert "aggregation must be one of mean, centered-clip" in text
    assert "clip_tau must be auto or a positive number" in text
    assert "clip_iterations" in text
    assert aggregation_of(RunConfig(aggregation="centered-clip", clip_tau="3")) == CenteredClip(3.0, 5)
    assert list(registry.AGGREGATIONS) == ["mean", "centered-clip"]  # the settings name what reducers do


def reduce(aggregation: Aggregation, contributions: list[tuple[torch.Tensor, float]], shape=(4,)):
    """Run one part through a RobustPartReducer, the senders one after the other as hivemind does; a sender
    whose part is refused is banned (as AllReduceRunner does). Returns (results per sender, reducer)."""

    async def main():
        reducer = RobustPartReducer([torch.Size(shape)], len(contributions), aggregation)
        results: list = [None] * len(contributions)

        async def send(i, part, weight):
            try:
                results[i] = await reducer.accumulate_part(i, 0, part, weight=weight)
            except Exception as e:
                reducer.on_sender_failed(i)
                results[i] = e

        await asyncio.gather(*(send(i, p, w) for i, (p, w) in enumerate(contributions)))
        return results, reducer

    return asyncio.run(main())


def test_the_reducer_averages_like_hivemind_with_mean():
    parts = [(torch.tensor([1.0, 2.0, 3.0, 4.0]), 1.0), (torch.tensor([3.0, 2.0, 1.0, 0.0]), 3.0)]
    results, _ = reduce(build("mean"), parts)
    expected = torch.tensor([2.5, 2.0, 1.5, 1.0])
    for r in results:
        torch.testing.assert_close(r, expected)


@pytest.mark.parametrize("aggregation", ["mean", "centered-clip"])
def test_a_nan_or_misshaped_part_is_dropped_and_the_others_are_averaged(aggregation):
    good = [(torch.tensor([1.0, 1.0, 1.0, 1.0]), 1.0), (torch.tensor([3.0, 3.0, 3.0, 3.0]), 1.0)]
    bad_nan = (torch.tensor([float("nan"), 0.0, 0.0, 0.0]), 1.0)
    bad_inf = (torch.tensor([float("inf"), 0.0, 0.0, 0.0]), 1.0)
    bad_shape = (torch.zeros(7), 1.0)
    results, reducer = reduce(build(aggregation, tau=100.0), [*good, bad_nan, bad_inf, bad_shape])
    for r in results[:2]:
        torch.testing.assert_close(r, torch.full((4,), 2.0))
    assert all(isinstance(r, Exception) for r in results[2:])
    assert reducer.suspicion() == [0, 0, 1, 1, 1]


@pytest.mark.parametrize("aggregation", ["mean", "centered-clip"])
def test_a_weight_beyond_float32_or_the_cap_is_refused_and_the_others_averaged(aggregation):
    good = [(torch.tensor([1.0, 1.0, 1.0, 1.0]), 1.0), (torch.tensor([3.0, 3.0, 3.0, 3.0]), 1.0)]
    # 1e39 travels as a double and is inf in float32; the others are not finite, negative or past the cap
    bad = [(torch.zeros(4), w) for w in (1e39, float("inf"), float("nan"), -1.0, robust.MAX_WEIGHT * 2)]
    results, reducer = reduce(build(aggregation, tau=100.0), [*good, *bad])
    for r in results[:2]:
        torch.testing.assert_close(r, torch.full((4,), 2.0))
    assert all(isinstance(r, AllreduceException) and "weight" in str(r) for r in results[2:])
    assert reducer.suspicion() == [0, 0, 1, 1, 1, 1, 1]
    # weights up to the cap are summed where they cannot overflow: their mean stays finite
    results, _ = reduce(build("mean"), [(torch.ones(4), robust.MAX_WEIGHT)] * 64)
    torch.testing.assert_close(results[0], torch.ones(4))


def test_a_combined_part_that_is_not_finite_is_never_returned_and_its_sender_is_refused():
    class Overflowing(Mean):  # a sum whose shares exceed one, as no aggregation of cotrain's makes
        def shares(self, weights: torch.Tensor) -> torch.Tensor:
            return torch.ones_like(weights, dtype=torch.float64)

    big = torch.full((4,), 3e38)
    results, reducer = reduce(Overflowing(), [(torch.ones(4), 1.0), (big, 1.0), (big * 0.9, 1.0)])
    # 3e38 + 2.7e38 overflows: the largest sender is refused, then 1 + 2.7e38 is finite
    for r in results:
        assert torch.isfinite(r).all()
        torch.testing.assert_close(r, torch.ones(4) + big * 0.9)
    assert reducer.refused == [0, 1, 0]


def test_the_reducer_combines_off_the_event_loop_one_part_at_a_time():
    import threading

    seen: list[str] = []

    class Watched(Mean):
        def shares(self, weights: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread().name)
            return super().shares(weights)

    results, _ = reduce(Watched(), [(torch.ones(4), 1.0), (torch.zeros(4), 1.0)])
    torch.testing.assert_close(results[0], torch.full((4,), 0.5))
    assert seen and all(name.startswith("reducer") for name in seen), seen


def test_an_auxiliary_sparse_reducer_stays_finite_when_a_sender_claims_a_huge_weight():
    """An auxiliary reducer (the monitor) of sparse rounds keeps what its records leave out for its next
    groups: a weight of 1e39 (inf in float32) once made that residue NaN, and every later group NaN."""
    from cotrain.algorithms.sparse import CHUNK, TopK
    from cotrain.hivemind_ext.reducers import RecordParts

    codec = TopK()
    local = torch.zeros(codec.encoded_size(CHUNK), dtype=torch.uint8)
    feedback = torch.zeros(CHUNK)
    aux = RecordParts([codec], [local], [local], feedback, carry=True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # rounds: two honest clients and the attacker
        sent = [codec.encode(torch.randn(CHUNK, generator=generator)) for _ in range(3)]

        async def main(sent: list[torch.Tensor] = sent):
            reducer = RobustPartReducer([local.shape], 3, Mean(), records=aux)

            async def send(i: int, weight: float):
                try:
                    return await reducer.accumulate_part(i, 0, sent[i], weight=weight)
                except AllreduceException as e:
                    reducer.on_sender_failed(i)
                    return e

            results = await asyncio.gather(send(0, 1.0), send(1, 1.0), send(2, 1e39))
            return results, reducer

        results, reducer = asyncio.run(main())
        assert isinstance(results[2], AllreduceException) and reducer.refused == [0, 0, 1]
        assert torch.equal(results[0], results[1]) and codec.problem(results[0]) == ""
        assert torch.isfinite(codec.decode(results[0])).all() and torch.isfinite(feedback).all()
        assert feedback.abs().sum() > 0  # the honest residue is carried, as before


def test_a_carried_residue_that_overflows_the_average_is_dropped_and_never_encoded():
    from cotrain.algorithms.sparse import CHUNK, TopK
    from cotrain.hivemind_ext.reducers import RecordParts

    codec = TopK()
    local = torch.zeros(codec.encoded_size(CHUNK), dtype=torch.uint8)
    aux = RecordParts([codec], [local], [local], torch.full((CHUNK,), 3e38), carry=True)
    average = torch.full((CHUNK,), 3e38)
    encoded, carried = aux.reduce_in_place(0, average, senders=2)
    assert encoded is None and carried and not aux.feedback.any()  # dropped: the next try goes without it
    encoded, carried = aux.reduce_in_place(0, torch.full((CHUNK,), 3e38), senders=2)
    assert encoded is not None and not carried and torch.isfinite(aux.feedback).all()
    with pytest.raises(ValueError, match="not finite"):
        aux.reduced(0, torch.full((CHUNK,), float("inf")), senders=2)


def test_the_replaced_reducer_retires_without_a_warning():
    import logging

    from hivemind.averaging.partition import TensorPartReducer

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("hivemind.averaging.partition")
    level, disabled = log.level, log.disabled
    log.setLevel(logging.WARNING)  # whatever earlier tests left on hivemind's loggers
    log.disabled = False
    log.addHandler(handler)

    async def main() -> None:  # reducers are made in the averager's event loop
        replaced = TensorPartReducer([torch.Size([4])], 3)
        robust.retire(replaced)
        replaced.finalize()
        assert replaced.finished.is_set() and not records
        TensorPartReducer([torch.Size([4])], 3).finalize()  # hivemind's own finalize would warn
        assert "received 0.0%" in records[-1].getMessage()

    try:
        asyncio.run(main())
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.disabled = disabled


class BareAveraging(robust.RobustAveraging):
    """The robust averaging's bookkeeping alone: no DHT, no serving loop, the peer id "me"."""

    peer_id = "me"

    def __init__(self, aggregation) -> None:
        self.aggregation = aggregation

    def __del__(self) -> None:  # no serving process to stop
        pass


@pytest.mark.parametrize("name", ["mean", "centered-clip"])
def test_a_late_sender_is_excluded_with_centered_clip_only(name):
    from types import SimpleNamespace

    averaging = BareAveraging(build(name))

    async def all_reduces() -> None:  # 3 all-reduces in which "slow" sent nothing within the sender timeout
        for _ in range(robust.STRIKES):
            reducer = RobustPartReducer([torch.Size([4])], 3, build(name))
            peers = ["me", "other", "slow"]
            runner = SimpleNamespace(
                tensor_part_reducer=reducer,
                sender_peer_ids=peers,
                ordered_peer_ids=peers,
                banned_senders={"slow"},
                bounded_by=0.0,
            )
            averaging._note_suspicion(runner)

    asyncio.run(all_reduces())
    assert averaging.excluded_peers() == ({"slow"} if name == "centered-clip" else set())


def test_a_received_change_is_bounded_by_the_own_contributions_norm():
    assert robust.received_scale(2.0, 1.5) == 1.0  # within the bound: applied whole
    assert robust.received_scale(2.0, 2.0 * robust.RECEIVED_BOUND) == 1.0
    assert robust.received_scale(2.0, 1000.0) == pytest.approx(2.0 * robust.RECEIVED_BOUND / 1000.0)
    assert robust.received_scale(0.0, 1000.0) == 1.0  # contributed nothing (weight 0): nothing to measure by


@pytest.mark.parametrize("group", [["me", "attacker"], ["me", "attacker", "other"]])
def test_in_a_pair_a_result_far_outside_the_bound_is_a_strike_against_the_other(group):
    from types import SimpleNamespace

    averaging = BareAveraging(build("centered-clip"))

    async def all_reduces() -> None:
        for _ in range(robust.STRIKES):
            runner = SimpleNamespace(
                tensor_part_reducer=RobustPartReducer([torch.Size([4])], len(group), averaging.aggregation),
                sender_peer_ids=group,
                ordered_peer_ids=group,
                banned_senders=set(),
                bounded_by=500.0,  # the result lay 500 x the bound away
            )
            averaging._note_suspicion(runner)

    asyncio.run(all_reduces())
    # in a larger group the bounded result cannot be pinned on one member (its reducers clipped the senders)
    assert averaging.excluded_peers() == ({"attacker"} if len(group) == 2 else set())


def test_the_reducer_counts_contributions_far_outside_tau():
    honest = [(torch.tensor([1.0, 1.0, 1.0, 1.0]) + 0.01 * i, 1.0) for i in range(4)]
    attack = (torch.full((4,), -1000.0), 1.0)
    results, reducer = reduce(build("centered-clip"), [*honest, attack])
    assert reducer.suspicion() == [0, 0, 0, 0, 1]
    assert all((r - 1.015).abs().max() < 0.05 for r in results)
