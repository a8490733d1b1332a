"""Robust aggregation (cotrain.hivemind_ext.reducers).

Here, with hivemind in the test process; the rest in tests/unit/algorithms/test_robust.py."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from cotrain.algorithms.aggregation import (
    Aggregation,
    build,
    capped_weights,
)
from cotrain.hivemind_ext import reducers as robust
from support.averagers import averagers


def run_round(
    tensors: list[list[torch.Tensor]],
    weights: list[float],
    aggregation: Aggregation,
    suspect: int | None = None,
    **options,
):
    """All-reduce ``tensors`` (one list per peer) once; returns each peer's averaged tensors and group
    size. A round where some peer found no group, or the peers split into smaller groups (matchmaking on a
    loaded machine), is run again, once; one where only the ``suspect`` peer never finished (the others did)
    is not: that peer's all-reduce hung. So is one where a peer other than the ``suspect`` was dropped from a
    reducer (its part late past the sender timeout on a loaded machine) or a reducer failed: the average then
    misses a peer by design. ``options`` replace the averagers' settings."""
    try:
        out, sizes, dropped = _run_round(tensors, weights, aggregation, **options)
        if any(size != len(tensors) for size in sizes) or any(
            d - {suspect} for i, d in enumerate(dropped) if i != suspect
        ):
            return _run_round(tensors, weights, aggregation, **options)[:2]
        return out, sizes
    except RoundStuck as stuck:
        if stuck.pending == [suspect]:
            raise
        return _run_round(tensors, weights, aggregation, **options)[:2]
    except AllreduceException:
        return _run_round(tensors, weights, aggregation, **options)[:2]


class RoundStuck(TimeoutError):
    def __init__(self, pending: list[int]):
        super().__init__(f"the all-reduce of peer(s) {pending} did not finish")
        self.pending = pending


def _run_round(tensors: list[list[torch.Tensor]], weights: list[float], aggregation: Aggregation, **options):
    records = Path(tempfile.mkdtemp(prefix="robust-test-"))
    made, dhts = averagers(tensors, aggregation, records=records, **options)
    try:
        # a round takes seconds; one where matchmaking went wrong on a loaded machine is run again soon
        controls = [a.step(weight=w, wait=False, timeout=30) for a, w in zip(made, weights, strict=True)]
        deadline = time.monotonic() + 40
        while not all(c.done() for c in controls) and time.monotonic() < deadline:
            time.sleep(0.2)
        if sum(not c.done() for c in controls) == 1:  # the others are done: a slow last one gets 40 s more
            deadline = time.monotonic() + 40
            while not all(c.done() for c in controls) and time.monotonic() < deadline:
                time.sleep(0.2)
        pending = [i for i, c in enumerate(controls) if not c.done()]
        if pending:
            raise RoundStuck(pending)
        sizes = [len(c.result()) for c in controls]
        out = []
        for a in made:
            with a.get_tensors() as ts:
                out.append([t.clone() for t in ts])
        return out, sizes, dropped_peers(made)
    finally:
        for a in made:
            a.shutdown()
        for d in dhts:
            d.shutdown()
        shutil.rmtree(records, ignore_errors=True)


def dropped_peers(made) -> list[set[int]]:
    """Per peer, in its last all-reduce: the peers (by index) its reducer dropped, with -1 where a reducer
    it sent to failed."""
    index = {str(a.peer_id): i for i, a in enumerate(made)}
    dropped = []
    for a in made:
        seen = json.loads(a.record.read_text()) if a.record.is_file() else {"banned": [], "failed": 0}
        dropped.append({index.get(p, -2) for p in seen["banned"]} | ({-1} if seen["failed"] else set()))
    return dropped


def honest_tensors(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(3000, generator=gen), torch.randn(50, 40, generator=gen)]
    return [[b + 0.3 * torch.randn(b.shape, generator=gen) for b in base] for _ in range(n)]


def weighted_mean(tensors, weights, members):
    w = torch.tensor([weights[i] for i in members])
    count = len(tensors[0])
    return [sum(w[k] * tensors[i][j] for k, i in enumerate(members)) / w.sum() for j in range(count)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_centered_clip_all_reduce_of_honest_peers_is_their_weighted_mean():
    tensors, weights = honest_tensors(4), [32.0, 16.0, 40.0, 24.0]
    out, sizes = run_round(tensors, weights, build("centered-clip"))
    assert sizes == [4, 4, 4, 4]
    # the weights count up to their median (24 here): [24, 16, 24, 24]
    expected = weighted_mean(tensors, capped_weights(torch.tensor(weights)).tolist(), range(4))
    for got in out:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=2e-3, rtol=0)  # fp32 on the wire: to the clip's iterations


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sign_flipped_peer_is_clipped_and_a_nan_peer_dropped():
    tensors, weights = honest_tensors(4, seed=1), [32.0, 32.0, 32.0, 1e6]
    honest = weighted_mean(tensors, weights, range(3))
    tensors[3] = [-1000 * h for h in honest]  # a sign flip x 1000, claiming a million samples
    out, sizes = run_round(tensors, weights, build("centered-clip"))
    spread = max((tensors[i][0] - honest[0]).norm().item() for i in range(3))
    for got in out[:3]:
        # the attacker moved the result by a fraction of the honest spread, not by 1000 x the gradient
        assert (got[0] - honest[0]).norm().item() < spread, (got[0] - honest[0]).norm()
    # NaN and Inf: refused by the reducers of either aggregation, its own included (its all-reduce ends, its
    # own part left as it was); the honest peers average among themselves
    tensors = honest_tensors(3, seed=2) + [
        [torch.full((3000,), float("nan")), torch.full((50, 40), float("inf"))]
    ]
    # refusing a part waits for no sender: the honest peers' parts get a sender timeout long enough that a
    # loaded machine (2 cores, the whole suite) does not drop one of them too, which would leave that part
    # partly averaged (hivemind keeps a failed part's local values)
    out, sizes = run_round(tensors, [1.0] * 4, build("mean"), suspect=3, next_chunk_timeout=20.0)
    assert sizes[:3] == [4, 4, 4], sizes  # the NaN peer was in the group, and dropped from the average
    expected = weighted_mean(tensors, [1.0] * 4, range(3))
    for got in out[:3]:
        assert all(torch.isfinite(g).all() for g in got)
        torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_in_a_pair_a_sign_flipped_peer_can_cancel_the_honest_update_not_reverse_it():
    """Two peers, one honest, one sending its gradient flipped x 1000: the median of two is their mean, so
    the reducers' clip holds nothing back; the honest peer's bound on what it receives does."""
    honest = honest_tensors(1, seed=3)[0]
    tensors, weights = [honest, [-1000 * h for h in honest]], [32.0, 32.0]
    own = torch.sqrt(sum(h.pow(2).sum() for h in honest))
    out, sizes = run_round(tensors, weights, build("mean"))
    assert sizes == [2, 2]
    moved = torch.sqrt(sum((g - h).pow(2).sum() for g, h in zip(out[0], honest, strict=True)))
    assert moved > 100 * own  # with the mean the attack is real: about -500 x the honest gradient
    out, sizes = run_round(tensors, weights, build("centered-clip"))
    assert sizes == [2, 2]
    got = out[0]
    moved = torch.sqrt(sum((g - h).pow(2).sum() for g, h in zip(got, honest, strict=True)))
    assert moved <= robust.RECEIVED_BOUND * own * 1.001, (moved, own)
    # what is left points no way against the honest gradient
    dot = sum((g * h).sum() for g, h in zip(got, honest, strict=True))
    assert dot >= -1e-3 * own**2, dot
