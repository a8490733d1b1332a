"""The rounds simulation's averaging: as a swarm of sparse rounds averages, with nothing lost overall, and its
forms for vocabulary matrices."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO
from cotrain.algorithms.sparse import TopK

sys.path.insert(0, str(REPO / "benchmarks"))
import rounds_sim  # noqa: E402


def test_the_rounds_simulation_averages_as_a_swarm_of_sparse_rounds_does():
    arm = rounds_sim.Arm.parse("topk:decay=0.9:density=0.03125:exact=lm_head,embed")
    assert (arm.codec, arm.exact, arm.union, arm.sparse) == (
        {"decay": 0.9, "density": 0.03125},
        ("lm_head", "embed"),
        False,
        True,
    )
    for bad in ("sparse", "dense:decay=0.9", "topk:colour=red", "topk:exact="):
        with pytest.raises(ValueError):
            rounds_sim.Arm.parse(bad)
    assert rounds_sim.spans(16_379, 4096, 2) == [(0, 8192), (8192, 16_379)]  # whole chunks, all covered
    codec, numel, n = TopK(decay=0.9), 3 * 4096, 3
    changes = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    feedback = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]
    wholes = [torch.add(c, f, alpha=0.9) for c, f in zip(changes, feedback, strict=True)]
    none = torch.zeros(numel, dtype=torch.bool)
    dense = rounds_sim.average(
        rounds_sim.Arm.parse("dense"), None, [c.clone() for c in changes], [], none, None
    )
    assert torch.allclose(dense, torch.stack(changes).mean(0))
    g = torch.Generator().manual_seed(0)
    mine = [f.clone() for f in feedback]
    out = rounds_sim.average(
        arm.__class__.parse("topk:decay=0.9"), codec, [c.clone() for c in changes], mine, none, g
    )
    sent = [codec.decode(codec.encode(w), numel) for w in wholes]
    mean = torch.stack(sent).mean(0)
    # the group's average is re-encoded to k per chunk; each peer keeps what it did not send, and the reducers
    # keep n times what the re-encoding left out, so that nothing is lost overall
    assert ((out.view(-1, 4096) != 0).sum(1) <= codec.k).all()
    total = sum(mine) - sum(w - s for w, s in zip(wholes, sent, strict=True))
    assert torch.allclose(total, n * (mean - out), atol=1e-5)
    # parameters sent exactly skip the codec on both sides
    everything = torch.ones(numel, dtype=torch.bool)
    exact = rounds_sim.average(
        arm, codec, [c.clone() for c in changes], [f.clone() for f in feedback], everything, g
    )
    assert torch.allclose(exact, torch.stack(wholes).mean(0), atol=1e-6)


def test_the_rounds_simulations_forms_for_vocabulary_matrices_lose_nothing_overall():
    arm = rounds_sim.Arm.parse("topk:decay=0.9:vdensity=0.125:vbits=4:vrows=0.25")
    assert (arm.vocab, arm.form) == ({"density": 0.125, "bits": 4}, ("rows", 0.25))
    assert rounds_sim.Arm.parse("topk:vshared").form == ("shared", 0.0)
    shapes = [torch.Size([64, 16]), torch.Size([32, 16])]
    flat = torch.randn(sum(s.numel() for s in shapes), generator=torch.Generator().manual_seed(0))
    there = rounds_sim.dct_rows(flat, shapes, 8)
    assert torch.allclose(there.norm(), flat.norm()) and not torch.allclose(there, flat)  # orthonormal
    assert torch.allclose(rounds_sim.dct_rows(there, shapes, 8, inverse=True), flat, atol=1e-5)
    rows = rounds_sim.top_rows(0.25)(flat[:1024].view(64, 16))
    assert (rows.abs().sum(1) > 0).sum() == 16  # a quarter of the rows, in two levels each
    assert all(len(set(r.abs().tolist()) - {0.0}) <= 2 for r in rows)
    assert torch.linalg.matrix_rank(rounds_sim.low_rank(2)(flat[:1024].view(64, 16))) == 2
    n = 3
    changes = [torch.randn(flat.numel(), generator=torch.Generator().manual_seed(i)) for i in range(n)]
    feedback = [torch.randn(flat.numel(), generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]
    before = [f.clone() for f in feedback]
    for form, reencode in ((rounds_sim.top_rows(0.25), True), (rounds_sim.low_rank(2), False)):
        mine, g = [f.clone() for f in before], torch.Generator().manual_seed(0)
        out = rounds_sim.per_matrix(form, shapes, [c.clone() for c in changes], mine, 0.9, g, reencode)
        # what the peers meant to send, less what the group applies, is in the buffers, n times over
        wholes = sum(c + 0.9 * f for c, f in zip(changes, before, strict=True))
        assert torch.allclose(wholes - n * out, sum(mine), atol=1e-4)
