"""Fault injection of malicious peers (cotrain.faults, COTRAIN_ATTACK).

Here, with hivemind in the test process; the rest in tests/live/test_attacks.py and
tests/unit/hivemind_ext/test_attacks.py."""

from __future__ import annotations

import pytest
import torch

from cotrain.faults import ATTACK


def make_averagers(tensors: list[list[torch.Tensor]], silent: int, monkeypatch):
    """One averager with cotrain's robust reducers (in its own process) per entry of ``tensors``; the one
    at index ``silent`` starts with COTRAIN_ATTACK=silent in its environment."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    from cotrain.hivemind_ext.reducers import RobustAveraging

    class Averager(RobustAveraging, DecentralizedAverager):
        pass

    local = ["/ip4/127.0.0.1/tcp/0"]
    first = hivemind.DHT(start=True, host_maddrs=local)
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=local, initial_peers=first.get_visible_maddrs())
        for _ in tensors[1:]
    ]
    made = []
    for i, (own, dht) in enumerate(zip(tensors, dhts, strict=True)):
        if i == silent:  # the averager's process takes the environment it starts with
            monkeypatch.setenv(ATTACK, "silent")
        else:
            monkeypatch.delenv(ATTACK, raising=False)
        made.append(
            Averager(
                [t.clone() for t in own],
                dht,
                prefix="silent-test",
                target_group_size=len(tensors),
                min_matchmaking_time=4.0,
                request_timeout=2.0,
                next_chunk_timeout=3.0,
                allreduce_timeout=20.0,
                part_size_bytes=PART_BYTES,
                start=True,
            )
        )
    monkeypatch.delenv(ATTACK, raising=False)
    return made, dhts


# 250 values a part, 12 parts of 3,000 values, 3 for each reducer: with one part (hivemind's default size) the
# whole vector goes to one reducer, the silent member in one group of four
PART_BYTES = 1000


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_silent_member_joins_the_group_and_contributes_nothing(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(3000, generator=gen)] for _ in range(3)]
    tensors.append([torch.full((3000,), 1e6)])  # the silent member: any of its values would show
    made, dhts = make_averagers(tensors, silent=3, monkeypatch=monkeypatch)
    try:
        # 30 s: matchmaking (4 s) and the all-reduce (its 20 s timeout) fit; the silent member, its round
        # failed after 19 s, looks for another group until then
        controls = [a.step(wait=False, timeout=30) for a in made]
        outcomes = []
        for c in controls:
            try:
                outcomes.append(len(c.result(90)))
            except Exception as e:
                outcomes.append(e)
        out = []
        for a in made:
            with a.get_tensors() as ts:
                out.append(ts[0].clone())
    finally:
        for a in made:
            a.shutdown()
        for d in dhts:
            d.shutdown()
    assert outcomes[:3] == [4, 4, 4], outcomes  # it was in their group ...
    assert isinstance(outcomes[3], BaseException), outcomes  # ... and failed the round for itself alone
    mean = sum(t[0] for t in tensors[:3]) / 3
    for own, got in zip(tensors[:3], out[:3], strict=True):
        # every value is the honest mean (parts reduced by honest peers) or the peer's own value (the part
        # the silent member should have reduced): nothing of the silent member's got in
        averaged = (got - mean).abs() < 1e-4
        kept = (got - own[0]).abs() < 1e-6
        assert (averaged | kept).all()
        assert averaged.float().mean() == pytest.approx(0.75)  # the 3 honest reducers' parts were averaged
