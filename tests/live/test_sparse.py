"""DiLoCo's sparse rounds (--outer-compression topk, cotrain.algorithms.sparse).

Here, with cotrain processes; the rest in tests/unit/algorithms/test_sparse.py."""

from __future__ import annotations

import pytest

from conftest import wait_until
from cotrain.algorithms.sparse import (
    TopK,
)
from support.diloco_peers import by_round, joint_rounds


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sparse_rounds_keep_the_members_bit_identical_a_client_a_latecomer_and_a_leaver_included(
    peers, tmp_path
):
    """a and b (full peers) average sparse rounds; c, in client mode, joins after two of them; b then leaves,
    and a (the one reducer left) carries on with c. In every round members shared, they applied the same
    averaged change and hold the same global parameters and momentum to the bit; a sparse round's payload is
    the records' size; the loss falls."""
    common = ["--outer-compression", "topk", "--width", "512", "--lr", "0.003", "--step-sleep", "0.15"]
    common += ["--rounds", "2"]  # the outer step: topk's default (lr 1, no momentum)
    stop_all, stop_b = tmp_path / "done", tmp_path / "b-leaves"
    a = peers("a", *common, "--until", str(stop_all))
    address = a.address()
    b = peers("b", *common, "--seed", "1", "--until", str(stop_b), "--initial-peers", *address)
    wait_until(lambda: len(joint_rounds([a, b])) >= 2, 150, what="two sparse rounds of a and b")
    c = peers(
        "c", *common, "--seed", "2", "--client-mode", "--until", str(stop_all), "--initial-peers", *address
    )
    try:
        wait_until(lambda: joint_rounds([a, b, c]), 150, what="a round of the three")
        stop_b.touch()
        assert b.wait(90) == 0, b.text()
        left = max(r["round"] for r in b.rows("outer"))
        wait_until(
            lambda: [r for r in joint_rounds([a, c]) if r > left], 150, what="a round of a and c after b left"
        )
    finally:
        stop_all.touch()
    for p in (a, c):
        assert p.wait(90) == 0, p.text()
    # c downloaded the swarm's state as it joined, with the lineage its donor vouched for where the other of a
    # and b attested it for that state: its first round with them need not carry the outer state (4 bytes a
    # parameter, against the records' 0.03); a lineage nobody else attested is a fresh one, carried once.
    # The lineages a and b held after the round before: whatever ended it for each (an all-reduce, a round
    # taken from the others' average, or one alone on a loaded machine)
    joined = c.rows("ready")[0]
    after = {r["lineage"] for p in (a, b) for r in p.rows("average") if r["round"] == joined["step"] - 1}
    first = min(c.rows("averaged"), key=lambda r: r["round"])
    assert joined["step"] >= 2 and (joined["lineage"] in after or first["carried"]), (joined, after, first)
    shared = {
        "a, b": (joint_rounds([a, b]), [a, b]),
        "a, b, c": (joint_rounds([a, b, c]), [a, b, c]),
        "a, c after b": ([r for r in joint_rounds([a, c]) if r > left], [a, c]),
    }
    outer = {p: by_round(p, "outer") for p in (a, b, c)}
    for name, (rounds, members) in shared.items():
        assert rounds, name
        for r in rounds:
            outers = [outer[p][r] for p in members]
            for key in ("applied", "after", "momentum"):
                assert all(o[key] == outers[0][key] for o in outers), (name, r, key)
    # the payload of a round without the outer state: the records, (n - 1) / n of them each way
    codec, numel = TopK(), 16 * 512 + 512 + 512 + 1
    steps = [s for s in a.rows("step") if s.get("round_bytes")]
    sizes = {s["round_bytes"] for s in steps}
    assert int(2 * codec.encoded_size(numel) / 2) in sizes, sizes  # a round of two
    assert min(sizes) * 30 < 2 * numel * 2, sizes  # against fp16's
    losses = [s["loss"] for s in a.rows("step") if s.get("loss") is not None]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def uncarried(peer, rounds: list[int]) -> list[int]:
    """Those of ``rounds`` whose all-reduce carried no outer state, as ``peer`` saw them."""
    averages = by_round(peer, "average")
    return [r for r in rounds if not averages[r]["carried"]]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_peer_late_for_its_round_takes_the_groups_average_and_stays_in_step(peers, tmp_path):
    """After a round of the three, c's step in a later round R lasts until a and b have averaged R without
    it. c does not apply its change alone: it takes a's and b's average from them
    (cotrain.hivemind_ext.roundresults), applies the same outer step, and holds their global parameters to
    the bit, in their lineage; its change goes into its next round, which the three average together without
    carrying the outer state, and after which they agree."""
    common = ["--outer-compression", "topk", "--width", "64", "--step-sleep", "0.15", "--local-steps", "40"]
    done, late = tmp_path / "done", tmp_path / "late"
    a = peers("a", *common, "--until", str(done))
    address = a.address()
    b = peers("b", *common, "--seed", "1", "--until", str(done), "--initial-peers", *address)
    c = peers(
        "c",
        *common,
        "--seed",
        "2",
        "--late-when",
        str(late),
        "--until",
        str(done),
        "--initial-peers",
        *address,
    )
    try:
        # a round of the three that left them one lineage (it carried no outer state: a newcomer's carries it)
        wait_until(lambda: uncarried(a, joint_rounds([a, b, c])), 150, what="a round of the three")
        late.touch()
        wait_until(lambda: c.rows("late"), 150, what="c's slow step")
        r = c.rows("late")[0]["round"]
        wait_until(lambda: [j for j in joint_rounds([a, b, c]) if j > r], 150, what="a round of all after it")
    finally:
        done.touch()
    for p in (a, b, c):
        assert p.wait(90) == 0, p.text()
    mine, theirs = by_round(c, "average")[r], by_round(a, "average")[r]
    assert mine["size"] == 1 and theirs["size"] == 2, (mine["size"], theirs["size"])
    assert mine["lineage"] == theirs["lineage"] == by_round(b, "average")[r]["lineage"]
    assert by_round(c, "outer")[r]["after"] == by_round(a, "outer")[r]["after"]  # the same step, to the bit
    joint = [j for j in joint_rounds([a, b, c]) if j > r]
    outers = [by_round(p, "outer")[joint[0]] for p in (a, b, c)]
    assert all(o["after"] == outers[0]["after"] for o in outers)
    assert not any(by_round(p, "averaged")[joint[0]]["carried"] for p in (a, b, c))
