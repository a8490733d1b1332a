"""State downloads that a malicious donor cannot poison (cotrain.hivemind_ext.statecheck).

Here, in the test process alone; the rest in tests/live/test_statecheck.py and
tests/swarm/test_statecheck.py."""

from __future__ import annotations

import math
import time

import pytest
import torch

from cotrain.faults import POISONED_PRIORITY_BONUS, PoisonedState
from cotrain.hivemind_ext import statecheck as sc


def state(seed: int = 0) -> list[torch.Tensor]:
    """A model-like state: an embedding, weights, a bias of zeros, a norm's weight of ones, a scalar."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(500, 32, generator=g) * 0.02,
        torch.randn(64, 32, generator=g) * 0.1,
        torch.zeros(64),
        torch.ones(64),
        torch.tensor(0.5),
    ]


def rounded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What an fp16 round trip (hivemind's averaging on the wire) leaves of a state."""
    return [t.half().float() for t in tensors]


def nudged(tensors: list[torch.Tensor], relative: float, seed: int = 1) -> list[torch.Tensor]:
    """Each tensor moved by ``relative`` x its RMS per coordinate, at random (an honest peer's step taken
    with its local instead of the averaged gradient is ~1e-2)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in tensors:
        rms = t.pow(2).mean().sqrt()
        out.append(t + relative * rms * torch.randn(t.shape, generator=g))
    return out


def poisoned_copy(tensors: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """What the poisoned-state attack serves for ``tensors`` (its random draw seeded, so a test sees one)."""
    attack = PoisonedState(True)
    attack.generator.manual_seed(seed)
    return attack.serve(tensors, len(tensors))


def test_honest_rounding_and_drift_pass():
    honest = sc.fingerprint(state(), 7)
    assert sc.distance(honest, sc.fingerprint(state(), 7)) == 0.0
    assert sc.distance(honest, sc.fingerprint(rounded(state()), 7)) < 1e-3
    assert sc.distance(honest, sc.fingerprint(nudged(state(), 1e-3), 7)) < 0.01
    assert sc.distance(honest, sc.fingerprint(nudged(state(), 0.02), 7)) < sc.TOLERANCE
    # the same values in another dtype (a peer that keeps its parameters in fp16 or bf16)
    assert sc.distance(honest, sc.fingerprint([t.bfloat16() for t in state()], 7)) < 0.01


@pytest.mark.parametrize(
    "poison",
    [
        pytest.param(poisoned_copy, id="random-same-norm"),
        pytest.param(lambda t: [x * 1000 for x in t], id="scaled-x1000"),
        pytest.param(lambda t: [-x for x in t], id="sign-flip"),
        pytest.param(lambda t: [x * 1.5 for x in t], id="scaled-x1.5"),
        pytest.param(lambda t: nudged(t, 0.5), id="noise-half-rms"),
        pytest.param(lambda t: [torch.full_like(x, float("nan")) for x in t], id="nan"),
        pytest.param(lambda t: t[:1] + [-t[1]] + t[2:], id="one-tensor-flipped"),
        pytest.param(lambda t: state(seed=9), id="another-initialization"),
    ],
)
def test_poisoned_states_fail(poison):
    honest = sc.fingerprint(state(), 7)
    assert sc.distance(honest, sc.fingerprint(poison(state()), 7)) > 3 * sc.TOLERANCE


def test_layouts_and_steps_are_not_mixed():
    honest = sc.fingerprint(state(), 7)
    assert sc.distance(honest, sc.fingerprint(state()[:-1], 7)) == math.inf
    assert sc.distance(honest, sc.fingerprint([state()[0].reshape(-1)] + state()[1:], 7)) == 0.0
    # other positions are sampled at another step: fingerprints of two steps never compare equal
    assert sc.distance(honest, sc.fingerprint(state(), 8)) > sc.TOLERANCE


def test_fingerprint_bytes_round_trip_and_record_schema():
    fp = sc.fingerprint(state(), 3)
    entry = sc.step_record(fp)
    assert len(entry.values) == 4 * len(fp.numels) * (1 + sc.SAMPLES_PER_TENSOR)
    assert sc.distance(fp, entry.fingerprint()) < 1e-6  # float32 on the wire
    record = sc.FingerprintRecord(states=[entry], peer_id="QmPeer", time=1.0)
    assert sc.FingerprintRecord.parse_obj(record.dict()).states[0].epoch == 3
    with pytest.raises(ValueError):  # a layout that does not match the sizes
        sc.StepFingerprint(**{**entry.dict(), "numels": list(fp.numels[:-1])})
    with pytest.raises(ValueError):  # values of another length
        sc.StepFingerprint(**{**entry.dict(), "values": entry.values[:-4]})
    with pytest.raises(ValueError):  # more steps than a record keeps
        sc.FingerprintRecord(states=[entry] * (sc.HISTORY + 1), peer_id="QmPeer")


def test_verdict_follows_the_majority_of_the_records_for_the_step():
    honest, other = sc.fingerprint(state(), 5), sc.fingerprint(rounded(nudged(state(), 2e-3)), 5)
    poisoned = sc.fingerprint(poisoned_copy(state()), 5)
    # 2 honest peers and a liar that publishes its honest state's fingerprint: the poisoned state is refuted
    records = {"h1": honest, "h2": other, "liar": other}
    assert sc.verdict(poisoned, records, {"liar"}).kind == "refuted"
    assert sc.verdict(honest, records, {"h1"}).accepted
    # the liar publishes the poisoned state's fingerprint: still 1 of 3, and the honest donors 2 of 3
    records = {"h1": honest, "h2": other, "liar": poisoned}
    found = sc.verdict(poisoned, records, {"liar"})
    assert found.kind == "refuted" and (found.agree, found.total) == (1, 3)
    assert found.nearest > 5 * found.tolerance
    assert sc.verdict(other, records, {"h2"}).accepted
    # one honest peer against one liar: nobody can tell, nothing is loaded from either
    assert sc.verdict(honest, {"h1": honest, "liar": poisoned}, {"h1"}).kind == "refuted"
    assert sc.verdict(poisoned, {"h1": honest, "liar": poisoned}, {"liar"}).kind == "refuted"
    # a record that names the donor is the donor's, whatever key signed it; a forger's record that names
    # an honest donor is one more vote, and not the donor's
    records = {"h1": honest, "h2": other, "forged-h1": poisoned}
    assert sc.verdict(honest, records, {"h1", "forged-h1"}).accepted
    # a donor's own record never vouches for it alone
    assert sc.verdict(poisoned, {"liar": poisoned}, {"liar"}).kind == "unverifiable"
    assert sc.verdict(honest, {}, {"h1"}).kind == "unverifiable"


def test_verdict_accepts_either_side_of_an_honest_split():
    """DiLoCo peers that averaged in two groups hold two states at the same round: either is loaded; a peer
    whose round failed alone is outvoted, as is a liar among them."""
    a, b = sc.fingerprint(state(), 5), sc.fingerprint(nudged(state(), 0.5, seed=2), 5)
    a2, b2 = sc.fingerprint(rounded(state()), 5), sc.fingerprint(rounded(nudged(state(), 0.5, seed=2)), 5)
    lone = sc.fingerprint(nudged(state(), 0.5, seed=3), 5)
    records = {"a1": a, "a2": a2, "b1": b, "b2": b2}
    assert sc.verdict(a, records, {"a1"}).accepted and sc.verdict(b2, records, {"b2"}).accepted
    records["lone"] = lone
    found = sc.verdict(lone, records, {"lone"})
    assert found.kind == "refuted" and found.agree == 1
    records = {"a1": a, "a2": a2, "b1": b}  # 2 against 1: the larger group wins
    assert sc.verdict(a, records, {"a1"}).accepted and not sc.verdict(b, records, {"b1"}).accepted


def test_verdict_samples_its_voters_in_a_large_swarm():
    honest = sc.fingerprint(state(), 5)
    records = {f"h{i}": honest for i in range(3 * sc.MAX_VOTERS)}
    found = sc.verdict(honest, records, {"h0"})
    assert found.accepted and found.total == sc.MAX_VOTERS


def test_donors_vouched_for_are_asked_first_and_suspects_last():
    fp = sc.fingerprint(state(), 5)
    steps = {"h1": [4, 5], "h2": [5], "liar": [5], "monitor": [2]}
    records = {f"key-{peer}": sc.Published(peer, dict.fromkeys(held, fp)) for peer, held in steps.items()}
    priorities = {"h1": 5.0, "h2": 5.0, "liar": 5.0 + POISONED_PRIORITY_BONUS, "monitor": 2.0, "far": 1e9}
    order = sc.donor_order(priorities, records, suspects={})
    # the liar's bonus puts it first among the peers at step 5 (what hivemind would do); a claim of a step
    # nobody else holds ("far") comes after every donor whose step others vouch for
    assert order[0] == ("liar", True)
    assert sorted(order[1:3]) == [("h1", True), ("h2", True)]
    assert order[3:] == [("far", False), ("monitor", False)]
    order = sc.donor_order(priorities, records, suspects={"liar": time.monotonic() + 60})
    assert order[-1][0] == "liar"


def test_a_donor_ahead_of_the_downloader_beats_a_vouched_for_one_that_is_not():
    # after a partition: the cut-off peer holds step 1 (vouched for by everyone's records); the trainer that
    # went on holds step 3, vouched for by its own records only
    fp = sc.fingerprint(state(), 1)
    steps = {"went-on": [1, 2, 3], "monitor": [1]}
    records = {f"key-{peer}": sc.Published(peer, dict.fromkeys(held, fp)) for peer, held in steps.items()}
    priorities = {"went-on": 3.0, "monitor": 1.0}
    assert sc.donor_order(priorities, records, {}) == [("monitor", True), ("went-on", False)]  # a newcomer
    assert sc.donor_order(priorities, records, {}, held=1) == [("went-on", False), ("monitor", False)]
    # nobody ahead (a peer that reloads its own step): vouched-for donors are still asked first
    assert sc.donor_order(priorities, records, {}, held=3) == [("monitor", True), ("went-on", False)]


def test_a_donor_beyond_the_witnessed_step_is_asked_only_when_no_other_serves():
    # an honest peer at 16 and a liar that ran ahead to 19 by claiming the samples of its own steps
    assert sc.within_witnessed({"honest": 16.0, "liar": 19.0}, 16) == ({"honest": 16.0}, ["liar"])
    # one step of slack (a peer that has just stepped), a claim that is not a number is beyond any step
    offered = {"a": 16.0, "b": 17.0, "c": float("inf")}
    assert sc.within_witnessed(offered, 16) == ({"a": 16.0, "b": 17.0}, ["c"])
    # no progress records, or every donor beyond (records not yet published): every donor is asked
    assert sc.within_witnessed({"a": 50.0}, None) == ({"a": 50.0}, [])
    assert sc.within_witnessed({"a": 50.0, "b": 60.0}, 10) == ({"a": 50.0, "b": 60.0}, [])


def test_the_tensors_a_served_state_names_are_counted_from_its_metadata():
    from hivemind.optim.state_averager import dump_optimizer_state, initialize_optimizer_state_

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    initialize_optimizer_state_(opt)
    meta, tensors = dump_optimizer_state(opt)  # exp_avg and exp_avg_sq per parameter (and Adam's step)
    assert sc.served_tensor_count({"optimizer_metadata": meta}, 2) == 2 + len(tensors) >= 2 + 4
    diloco = {"outer_tensors": 7, "inner_metadata": meta, "optimizer_metadata": []}
    assert sc.served_tensor_count(diloco, 2) == 7 + len(tensors)
    assert sc.served_tensor_count({}, 2) == 2  # nothing named beyond the parameters
    assert sc.served_tensor_count({"optimizer_metadata": "garbage", "outer_tensors": True}, 2) == 2


def test_the_poisoned_state_fault():
    honest = state()
    assert PoisonedState(False).serve(honest, 5) == honest
    assert PoisonedState(False).priority(4.0) == 4.0
    attack = PoisonedState(True)
    served = attack.serve(honest, 2)
    assert attack.priority(4.0) == 4.0 + POISONED_PRIORITY_BONUS
    assert served[2:] == honest[2:]  # only the first ``count`` tensors (the parameters) are replaced
    for t, s in zip(honest[:2], served[:2], strict=True):
        assert s.shape == t.shape and not torch.equal(s, t)
        assert torch.linalg.vector_norm(s).item() == pytest.approx(torch.linalg.vector_norm(t).item(), 1e-4)
    assert torch.equal(honest[0], state()[0])  # the holder's own tensors are left as they were


def test_verdict_where_every_honest_peer_holds_a_state_of_its_own():
    """Small averaging groups whose members mix: 8 honest records at the step, each ~0.3 from the others (no
    two within TOLERANCE); an honest donor's state is loaded, a sign-flipped or random one is not."""
    honest = [sc.fingerprint(nudged(state(), 0.3, seed=10 + i), 5) for i in range(8)]
    assert all(sc.distance(a, b) > sc.TOLERANCE for i, a in enumerate(honest) for b in honest[i + 1 :])
    records = {f"h{i}": fp for i, fp in enumerate(honest)}
    spread = sc.spread(list(honest))
    assert sc.TOLERANCE < spread < 1.0
    found = sc.verdict(honest[0], records, {"h0"})
    assert found.accepted  # the donor's own record left out of the spread
    assert found.tolerance == pytest.approx(sc.SPREAD_FACTOR * sc.spread(honest[1:]))
    poisoned = sc.fingerprint(poisoned_copy(state()), 5)
    records["liar"] = poisoned
    found = sc.verdict(poisoned, records, {"liar"})
    assert found.kind == "refuted" and found.nearest > found.tolerance
    flipped = sc.fingerprint([-t for t in state()], 5)
    assert sc.verdict(flipped, records, {"liar"}).kind == "refuted"
    # where honest peers agree, one liar's far record does not widen the tolerance
    close = {f"h{i}": sc.fingerprint(rounded(nudged(state(), 1e-3, seed=i)), 5) for i in range(3)}
    assert sc.spread([*close.values(), poisoned]) < sc.TOLERANCE


def test_verdict_where_small_groups_agree_within_each_and_not_across():
    """Groups of 2 to 4 that averaged together, far apart from each other: a state that another peer's record
    vouches for is loaded though a larger group exists, unless that group is a strict majority; one liar is
    refuted either way."""
    centres = [nudged(state(), 0.5, seed=20 + g) for g in range(3)]
    sizes = [2, 3, 4]
    records = {
        f"g{g}m{m}": sc.fingerprint(rounded(nudged(centres[g], 1e-3, seed=100 * g + m)), 5)
        for g, size in enumerate(sizes)
        for m in range(size)
    }
    assert sc.spread(list(records.values())) < sc.TOLERANCE / 2  # each record has a near twin
    donor = sc.fingerprint(centres[0], 5)
    found = sc.verdict(donor, records, {"g0m0"})
    assert found.accepted and (found.agree, found.total) == (2, 9)  # 2 agree, a group of 4 is no majority
    poisoned = sc.fingerprint(poisoned_copy(state()), 5)
    assert sc.verdict(poisoned, {**records, "liar": poisoned}, {"liar"}).kind == "refuted"
    # a group holding a strict majority of the records outvotes a smaller one
    records.update(
        {f"g2m{m}": sc.fingerprint(rounded(nudged(centres[2], 1e-3, seed=m)), 5) for m in range(4, 7)}
    )
    found = sc.verdict(donor, records, {"g0m0"})
    assert found.kind == "refuted" and (found.agree, found.total) == (2, 12)
    # where honest peers agree, two liars that publish the same poisoned fingerprint are outvoted
    agreeing = {f"h{i}": sc.fingerprint(rounded(nudged(state(), 1e-3, seed=i)), 5) for i in range(3)}
    liars = {"liar1": poisoned, "liar2": poisoned}
    assert sc.verdict(poisoned, {**agreeing, **liars}, {"liar1"}).kind == "refuted"


def test_verdict_counts_a_rival_group_among_the_records_that_disagree():
    """A record halfway between two states agrees with both: it counts for the donor's state, not also for the
    rival group (3 against 3 of 6 is no majority for the rival)."""
    a, b = state(), nudged(state(), 0.15, seed=7)
    middle = [(x + y) / 2 for x, y in zip(a, b, strict=True)]
    fa, fb, fm = (sc.fingerprint(t, 5) for t in (a, b, middle))
    assert sc.distance(fa, fb) > sc.TOLERANCE >= max(sc.distance(fa, fm), sc.distance(fb, fm))
    records = {"a0": fa, "a1": sc.fingerprint(rounded(a), 5), "m": fm}
    records.update({f"b{i}": sc.fingerprint(rounded(nudged(b, 1e-3, seed=i)), 5) for i in range(3)})
    found = sc.verdict(fa, records, {"a0"})
    assert found.accepted and (found.agree, found.total, found.rivals) == (3, 6, 3)
    records["b3"] = sc.fingerprint(rounded(nudged(b, 1e-3, seed=3)), 5)  # now 4 of 7 agree on the other
    found = sc.verdict(fa, records, {"a0"})
    assert found.kind == "refuted" and found.rivals == 4 and found.nearest <= found.tolerance


def test_the_initial_peers_record_outweighs_any_count_of_keys():
    # five keys vouch for a poisoned state, two peers (the initial peer among them) publish the honest one
    honest, poisoned = state(0), [-t for t in state(0)]
    h, p = sc.fingerprint(honest, 3), sc.fingerprint(poisoned, 3)
    records = {f"sybil{i}": p for i in range(5)} | {"anchor": h, "other": h}
    by_count = sc.verdict(p, records, {"sybil0"})
    assert by_count.accepted  # by count the poisoned state wins
    weighed = sc.weigh_trusted(by_count, p, anchors=[h])
    assert weighed.kind == "refuted" and weighed.trusted == "initial peer"
    honest_by_count = sc.verdict(h, records, {"other"})
    assert not honest_by_count.accepted  # the sybils' majority refutes the honest state
    assert sc.weigh_trusted(honest_by_count, h, anchors=[h]).accepted
    # the initial peer's own state is loaded; a peer's own earlier record vouches but never refutes
    assert sc.weigh_trusted(sc.verdict(p, {"x": h}, ()), p, donor_is_anchor=True).accepted
    assert sc.weigh_trusted(honest_by_count, h, own=[h]).accepted
    assert sc.weigh_trusted(by_count, p, own=[h]).accepted  # its own state after a partition may differ
    assert sc.weigh_trusted(by_count, p) == by_count  # no trusted record: the count stands


def test_a_state_with_a_nan_or_inf_anywhere_is_never_loaded():
    honest = [*state(), torch.tensor(3, dtype=torch.int64)]  # an optimizer's step count rides along
    assert sc.state_finite(honest)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in range(len(honest) - 1):
            served = [t.clone() for t in honest]
            served[i].view(-1)[-1] = bad
            assert not sc.state_finite(served), (bad, i)
