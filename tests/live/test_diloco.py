"""The DiLoCo strategy (cotrain.strategies.diloco_rounds), on its own and in live swarms on 127.0.0.1.

Here, with cotrain processes; the rest in tests/swarm/test_diloco.py and
tests/unit/strategies/test_diloco.py."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import wait_until
from cotrain.algorithms.lineage import (
    periodic_round,
)
from support.diloco_peers import Peer, by_round, joint_rounds

FP16_TOL = 2e-3  # relative to the pseudo-gradients' scale: what fp16 rounding of the averaged part leaves


def outer_step(before: list[float], applied: list[float], momentum: list[float]) -> torch.Tensor:
    """SGD with Nesterov momentum (lr 0.7, momentum 0.9) from ``before`` along ``applied``, recomputed."""
    param = torch.nn.Parameter(torch.tensor(before))
    opt = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    param.grad = torch.zeros_like(param)
    opt.step()  # a momentum buffer, then the peer's
    opt.state[param]["momentum_buffer"].copy_(torch.tensor(momentum))
    param.grad = torch.tensor(applied)
    opt.step()
    return param.detach()


def spread(rows: list[dict], key: str) -> torch.Tensor:
    """How far apart the rows' ``key`` lie, element by element."""
    values = torch.tensor([row[key] for row in rows])
    return values.max(0).values - values.min(0).values


def drift_bounds(members: list[Peer], lr: float = 0.7, momentum: float = 0.9) -> dict[int, torch.Tensor]:
    """For every round all ``members`` stepped in: how far apart their global parameters can lie after the
    outer step, element by element, from what went into it. A round that carried the outer state starts from
    the spread of the state it averaged (its fp16 rounding, checked in check_rounds); any other round adds the
    spread of the averages it applied (their rounding, also checked) to the spread the previous round left,
    through the Nesterov update: the momentum buffers part by momentum x theirs + that spread, the parameters
    by lr x (that spread + momentum x the buffers'). Where a member's round did not start from the parameters
    and momentum its previous round left, the bound starts again from what was observed."""
    outers = [by_round(p, "outer") for p in members]
    averages = [by_round(p, "average") for p in members]
    common = sorted(set.intersection(*(set(o) for o in outers), *(set(a) for a in averages)))
    bounds: dict[int, torch.Tensor] = {}
    theta = buffers = None
    for r in common:
        rows = [o[r] for o in outers]
        continued = theta is not None and r - 1 in bounds and not any(a[r]["carried"] for a in averages)
        continued = continued and all(
            torch.allclose(torch.tensor(o[r]["before"]), torch.tensor(o[r - 1]["after"]), atol=1e-6, rtol=0)
            and torch.allclose(
                torch.tensor(o[r]["momentum_before"]), torch.tensor(o[r - 1]["momentum"]), atol=1e-6, rtol=0
            )
            for o in outers
        )
        if not continued:
            theta, buffers = spread(rows, "before"), spread(rows, "momentum_before")
        applied = spread(rows, "applied")
        buffers = momentum * buffers + applied
        theta = theta + lr * (applied + momentum * buffers)
        bounds[r] = theta
    return bounds


def check_rounds(members: list[Peer], rounds: list[int]) -> None:
    """In each of ``rounds`` every member averaged in one group of them all: the average change is the
    samples-weighted mean of their own changes, the average global parameters (where the group carried them)
    the same mean of theirs, and their outer steps agree with a recompute; their global parameters lie apart
    by no more than the rounding of the averages since the outer state last rode along (drift_bounds)."""
    averages = [by_round(p, "average") for p in members]
    outers = [by_round(p, "outer") for p in members]
    bounds = drift_bounds(members)
    for r in rounds:
        rows = [a[r] for a in averages]
        assert all(row["size"] == len(members) for row in rows), [row["size"] for row in rows]
        weights = torch.tensor([float(row["weight"]) for row in rows])
        owns = torch.tensor([row["own"] for row in rows])
        expected = (weights[:, None] * owns).sum(0) / weights.sum()
        scale = owns.abs().max().item()
        globs = torch.tensor([row["global"] for row in rows])
        expected_global = (weights[:, None] * globs).sum(0) / weights.sum()
        # the global parameters travel in fp16 too: where peers differ, the average carries their rounding
        spread_before = (globs - globs[0]).abs().max().item()
        glob_tol = FP16_TOL * scale + (1e-3 * globs.abs().max().item() if spread_before > 0 else 0.0)
        # the outer state rides along exactly when the members' lineages differ, or every OUTER_STATE_EVERY
        # rounds; peers of one lineage hold the same global parameters, to the rounding of earlier averages
        same_lineage = len({row["lineage_before"] for row in rows}) == 1
        assert all(row["carried"] == (not same_lineage or periodic_round(r)) for row in rows), rows
        if same_lineage and r - 1 in bounds:
            apart = spread(rows, "global")
            assert (apart <= bounds[r - 1] + 1e-5).all(), (r, apart, bounds[r - 1])
        # after a whole all-reduce (a partial one gives a fresh lineage) the members share one
        if not any(row["partial"] for row in rows):
            assert len({row["lineage"] for row in rows}) == 1, rows
        for row in rows:
            torch.testing.assert_close(torch.tensor(row["averaged"]), expected, atol=FP16_TOL * scale, rtol=0)
            if row["carried"]:
                got = torch.tensor(row["averaged_global"])
                torch.testing.assert_close(got, expected_global, atol=glob_tol, rtol=0)
        for outer in outers:
            row = outer[r]
            recomputed = outer_step(row["before"], row["applied"], row["momentum_before"])
            torch.testing.assert_close(torch.tensor(row["after"]), recomputed, atol=1e-6, rtol=1e-5)
        after = spread([outer[r] for outer in outers], "after")
        assert (after <= bounds[r] + 1e-5).all(), (r, after, bounds[r])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_peers_average_pseudo_gradients_newcomers_and_a_client_included(peers, tmp_path):
    done = tmp_path / "done"
    a = peers("a", "--rounds", "3", "--step-sleep", "0.2", "--until", str(done))
    address = a.address()
    b = peers(
        "b",
        "--rounds",
        "3",
        "--seed",
        "1",
        "--step-sleep",
        "0.2",
        "--until",
        str(done),
        "--initial-peers",
        *address,
    )
    # a newcomer in client mode (it accepts no connections): it joins once the others have averaged, and runs
    # until it has averaged with both (its rounds count from before it caught up with the swarm's round)
    # two rounds of a and b first: their second carries the pseudo-gradients alone (asserted below)
    wait_until(lambda: sum(r["size"] == 2 for r in b.rows("average")) >= 2, 150, what="two rounds of two")
    c_args = ["--rounds", "3", "--seed", "2", "--step-sleep", "0.2", "--client-mode", "--until", str(done)]
    c = peers("c", *c_args, "--initial-peers", *address, *b.address())
    try:
        wait_until(lambda: joint_rounds([a, b, c]), 240, what="a round of the three")
    finally:
        done.touch()
    for p in (a, b, c):
        assert p.wait(90) == 0, p.text()
    # the average is the samples-weighted mean of the peers' own changes, the outer step its recompute
    pairs = joint_rounds([a, b])
    assert pairs, (a.rows("average"), b.rows("average"))
    check_rounds([a, b], pairs)
    trio = joint_rounds([a, b, c])
    assert trio, [p.rows("average") for p in (a, b, c)]
    check_rounds([a, b, c], trio)
    # a newcomer downloads the state as it joins: a peer serves its state with its lineage (from its start,
    # after each round, alone too), and the newcomer takes it where another peer's record attests it for
    # that state (its rounds with them then leave the outer state out), else starts a fresh one, and its
    # first round with them carries the outer state; at round 0, without a download too, all start in the
    # lineage of the same initial weights
    for newcomer, others, first in ((b, [a], pairs[0]), (c, [a, b], trio[0])):
        joined = newcomer.rows("ready")[0]
        if joined["step"] == 0:  # the lineage of the initial weights, unless its state came without one
            held = {p.rows("ready")[0]["lineage"] for p in others}
            carried = by_round(newcomer, "average")[first]["carried"]
            assert joined["lineage"] in held or carried, (joined, held)
            continue
        held = {r["lineage"] for p in others for r in p.rows("average") if r["round"] == joined["step"] - 1}
        rounds = by_round(newcomer, "average")
        own_first = rounds[min(rounds)]
        if len(others) == 1:  # its donor's word alone (nobody else holds that lineage): a fresh one
            assert joined["lineage"] not in held, (joined, held)
        assert joined["lineage"] in held or own_first["carried"] or own_first["size"] == 1, (
            joined,
            own_first,
        )
    # rounds among peers that already averaged together carry the pseudo-gradients alone
    b_averages = by_round(b, "average")
    joint = [b_averages[r] for r in pairs + trio]
    assert any(not row["carried"] for row in joint), joint
    # the newcomers started at the swarm's round, from its global parameters
    assert c.rows("ready")[0]["step"] >= 2
    # every all-reduce stream went over a direct connection, the client's to the two others' included
    transport = [p.rows("done")[0]["transport"] for p in (a, b, c)]
    assert all(t["direct"] > 0 and t["libp2p"] == 0 for t in transport), transport
    assert [t["served"] > 0 for t in transport] == [True, True, False], transport
    steps = c.rows("step")
    assert steps and all(s["strategy"] == "diloco" and s["inner_steps"] > 0 for s in steps)
    assert any(s["round_bytes"] > 0 for s in steps)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_killed_mid_round_stalls_nobody_past_the_timeout(peers, tmp_path):
    timeout = 12.0
    done = tmp_path / "done"  # a and b go on past their 8 rounds until 2 rounds each ended after the kill
    common = ["--step-sleep", "0.2", "--averaging-timeout", str(timeout)]
    a = peers("a", "--rounds", "8", "--until", str(done), *common)
    address = a.address()
    b = peers("b", "--rounds", "8", "--seed", "1", "--until", str(done), "--initial-peers", *address, *common)
    c = peers("c", "--rounds", "20", "--seed", "2", "--initial-peers", *address, *common)
    # once the three have averaged together, kill c in the middle of its next round
    try:
        wait_until(lambda: any(r["size"] == 3 for r in c.rows("average")), 210, what="a round of three")
    except AssertionError as timed_out:
        rounds = {
            p.out.stem: [(r["round"], r["size"], round(r["ended"] - r["began"])) for r in p.rows("average")]
            for p in (a, b, c)
        }
        raise AssertionError(f"{timed_out}; rounds (round, size, seconds): {rounds}") from None
    time.sleep(0.6)
    c.kill()
    killed_at = time.time()
    try:
        wait_until(
            lambda: all(sum(r["ended"] > killed_at for r in p.rows("average")) >= 2 for p in (a, b)),
            150,
            what="two rounds of each survivor after the kill",
        )
    finally:
        done.touch()
    for p in (a, b):
        assert p.wait(200) == 0, p.text()
    after = [r for p in (a, b) for r in p.rows("average") if r["ended"] > killed_at]
    assert after, "no round after the kill"
    # every round that was under way or started after the kill ended within the averaging timeout (plus the
    # matchmaking of one retry), and the survivors went on averaging with each other
    assert max(r["ended"] - r["began"] for r in after) < timeout + 6, after
    assert any(r["size"] == 2 for r in after), after


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk"])
def test_overlapped_rounds_keep_the_global_parameters_together(peers, tmp_path, sparse):
    """Two peers with overlapped rounds hold the same global parameters after every round they averaged
    whole: to fp16's rounding (dense), to the bit with sparse records (encoded and decoded off the training
    thread, cotrain.strategies.overlap.RoundEnds); the loss falls."""
    done = tmp_path / "done"
    # an outer step applied one round late is stable while its gain, lr x (1 + momentum) for Nesterov, stays
    # below 1 (docs/diloco.md): this problem's inner optimizer reaches its optimum within a round
    stable = ["--overlap", "--outer-lr", "0.5", "--outer-momentum", "0"]
    if sparse:
        stable += ["--outer-compression", "topk", "--width", "512", "--lr", "0.003"]
    a = peers("a", "--rounds", "4", "--step-sleep", "0.2", *stable, "--until", str(done))
    b_args = ["--rounds", "5", "--seed", "1", "--step-sleep", "0.1", *stable, "--until", str(done)]
    b = peers("b", *b_args, "--initial-peers", *a.address())

    def grouped() -> list[int]:
        # rounds both averaged whole (a partial all-reduce, a part that timed out on a loaded machine, leaves
        # the peers apart by design until the next round carries the outer state): both go on until one is
        outers = [by_round(a, "outer"), by_round(b, "outer")]
        common = sorted(set(outers[0]) & set(outers[1]))
        return [r for r in common if all(o[r]["size"] == 2 and not o[r]["partial"] for o in outers)]

    try:
        wait_until(grouped, 180, what="a round the two peers averaged whole")
    finally:
        done.touch()
    assert b.wait(120) == 0, b.text()
    assert a.wait(60) == 0, a.text()
    outers = [by_round(a, "outer"), by_round(b, "outer")]
    for r in grouped():
        if sparse:
            assert all(outers[0][r][key] == outers[1][r][key] for key in ("applied", "after")), r
            continue
        first, second = torch.tensor(outers[0][r]["after"]), torch.tensor(outers[1][r]["after"])
        scale = torch.tensor(outers[0][r]["applied"]).abs().max().item()
        # the averaged outer state travels in fp16: the peers agree to its rounding
        glob_tol = 1e-3 * torch.tensor(outers[0][r]["before"]).abs().max().item()
        torch.testing.assert_close(first, second, atol=2 * FP16_TOL * scale + glob_tol, rtol=0)
    losses = [s["loss"] for s in a.rows("step") if s["loss"] is not None]
    assert losses[-1] < losses[0], losses
