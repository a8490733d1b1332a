"""Rounds of several peers simulated in one process with the engine's own pieces, checked exactly.

Each peer sends the records of its round's change with its error feedback
(cotrain.strategies.overlap.encode_with_feedback); the reducer of the part decodes and averages them with the
swarm's aggregation's shares and re-encodes the average, keeping what that leaves out in its own feedback
(cotrain.hivemind_ext.reducers.RecordParts); every member decodes the same records and applies the outer step
(cotrain.hivemind_ext.diloco_state.outer_optimizer_factory); every member of the group takes the same lineage
(cotrain.algorithms.lineage). Dense rounds with CenteredClip go through cotrain.algorithms.aggregation.
What the live sparse and robust tests check across processes (tests/live/test_sparse.py,
tests/swarm/test_robust.py) is checked here on every value: those tests need only check that the pieces meet
over the network.
"""

from __future__ import annotations

import torch

from cotrain.algorithms.aggregation import build
from cotrain.algorithms.lineage import carries_outer_state, initial_lineage, next_lineage
from cotrain.algorithms.sparse import TopK
from cotrain.hivemind_ext.diloco_state import outer_optimizer_factory
from cotrain.hivemind_ext.reducers import RecordParts, add_values
from cotrain.strategies.overlap import encode_with_feedback

NUMEL = 4096  # one part: 16 chunks of 256 values


class PeerId(bytes):
    """A peer id as a group's gathered mapping keys it (to_bytes(), as hivemind's PeerID)."""

    def to_bytes(self) -> bytes:
        return bytes(self)


def changes_of(peers: int, round_: int, seed: int) -> list[torch.Tensor]:
    """Each peer's change of a round: a shared direction plus its own noise, a few values much larger."""
    g = torch.Generator().manual_seed(seed * 1000 + round_)
    shared = torch.randn(NUMEL, generator=g)
    out = []
    for _ in range(peers):
        change = shared + 0.5 * torch.randn(NUMEL, generator=g)
        change[torch.randint(0, NUMEL, (8,), generator=g)] *= 20
        out.append(change * 1e-2)
    return out


def sparse_round(codec: TopK, changes, feedback, reducer_feedback, weights):
    """One sparse round of a group: what each member sent, the records of the average every member
    receives, and the average before its re-encoding."""
    sent = [
        encode_with_feedback(codec, change.clone(), fb) for change, fb in zip(changes, feedback, strict=True)
    ]
    shares = build("mean").shares(torch.tensor(weights, dtype=torch.float64))
    average = torch.zeros(NUMEL)
    for records, share in zip(sent, shares.tolist(), strict=True):
        add_values(records, average, codec, share)
    before = average.clone()
    part = torch.empty(codec.encoded_size(NUMEL), dtype=torch.uint8)
    reduced = RecordParts([codec], [part], [part], reducer_feedback).reduced(0, average, len(sent))
    return sent, reduced, before


def test_sparse_rounds_keep_every_members_state_bit_identical_and_lose_nothing_to_the_records():
    """4 peers, 6 rounds, no decay: every member applies the same outer step to the bit; each peer's records
    plus its feedback buffer hold exactly the changes it made (nothing is lost, only delayed); the reducer's
    re-encoding keeps what it leaves out, times the senders, in its buffer; and the members' parameters move
    by the mean of the records, not by anything the records left out."""
    codec, peers, rounds = TopK(density=1 / 16, bits=4, chunk=256), 4, 6
    torch.manual_seed(0)
    start = torch.randn(NUMEL)
    params = [torch.nn.Parameter(start.clone()) for _ in range(peers)]
    outer = [outer_optimizer_factory(0.7, 0.9)([p]) for p in params]
    feedback = [torch.zeros(NUMEL) for _ in range(peers)]
    reducer_feedback = torch.zeros(NUMEL)
    made = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(peers)]
    sent_total = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(peers)]
    for r in range(rounds):
        changes = changes_of(peers, r, seed=1)
        for i, c in enumerate(changes):
            made[i] += c.double()
        held_before = reducer_feedback.clone()
        sent, reduced, before = sparse_round(codec, changes, feedback, reducer_feedback, [1.0] * peers)
        for i, records in enumerate(sent):
            assert records.dtype == torch.uint8 and records.numel() == codec.encoded_size(NUMEL)
            sent_total[i] += codec.decode(records, NUMEL).double()
        # the reducer's buffer gained what the records of the average left out, times the senders
        left_out = before - codec.decode(reduced, NUMEL)
        torch.testing.assert_close(reducer_feedback - held_before, left_out * peers, rtol=0, atol=1e-6)
        applied = codec.decode(reduced, NUMEL)
        for p, opt in zip(params, outer, strict=True):  # every member, from the same bytes
            p.grad = applied.clone()
            opt.step()
        first = params[0].detach()
        assert all(torch.equal(first, p.detach()) for p in params[1:]), f"round {r}: members differ"
    for i in range(peers):  # error feedback: sent + still held == made, to float32 rounding
        torch.testing.assert_close(sent_total[i] + feedback[i].double(), made[i], rtol=0, atol=1e-5)
    # the records carry most of a change and the buffers stay small against what was made
    assert all(float(fb.norm()) < 0.5 * float(m.norm()) for fb, m in zip(feedback, made, strict=True))
    assert not torch.equal(params[0].detach(), start)


def test_a_decayed_buffer_fades_what_stays_unsent_and_a_member_applies_only_whole_records():
    """With decay 0.5, each round's records encode the change plus half the buffer: what a peer holds back
    fades geometrically instead of piling up; records of a shorter part are refused (problem())."""
    codec = TopK(density=1 / 16, bits=4, chunk=256, decay=0.5)
    change, fb = torch.zeros(NUMEL), torch.zeros(NUMEL)
    change[:256] = torch.linspace(0.01, 1.0, 256)  # one chunk: 16 values kept of 256
    encode_with_feedback(codec, change.clone(), fb)
    held = float(fb.abs().sum())
    for _ in range(5):  # no new change: the held values fade or go out as records
        encode_with_feedback(codec, torch.zeros(NUMEL), fb)
    assert 0 < held and float(fb.abs().sum()) < held * 0.5**5 + 1e-6
    records = codec.encode(change)
    assert codec.problem(records[:-1]) and not codec.problem(records)


def test_a_centered_clip_round_stays_near_the_honest_peers_whatever_one_peer_sends_and_claims():
    """Dense rounds of 5 peers with CenteredClip: one peer sends a change 10^6 times the others' and claims a
    weight 10^9 times theirs; the combined change stays within tau of the honest peers' mean (the plain mean
    is moved by about 2 x 10^5), and the weights are capped at the median."""
    g = torch.Generator().manual_seed(3)
    honest = torch.randn(4, 1000, generator=g) * 0.1 + 1.0
    attacker = torch.full((1, 1000), 1e6)
    parts = torch.cat([honest, attacker])
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e9], dtype=torch.float64)
    tau = 5.0  # the honest peers lie about 3 apart (0.1 x sqrt(1000))
    clip = build("centered-clip", tau=tau, iterations=20)
    result, outliers = clip.combine(parts, weights)
    target = honest.mean(dim=0)
    assert float((result - target).norm()) < tau, float((result - target).norm())
    assert outliers is not None and outliers.tolist() == [False, False, False, False, True]
    mean, _ = build("mean").combine(parts, weights)
    assert float((mean - target).norm()) > 1e5  # what the attacker does to a plain mean of its claim
    # a group without the attacker: CenteredClip of honest peers close together is their weighted mean
    result, _ = clip.combine(honest, torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(result, target, rtol=0, atol=1e-5)


def test_members_of_a_group_take_one_lineage_and_a_peer_that_averaged_elsewhere_makes_the_state_travel():
    """Four members that gathered the same (peer, lineage) items in any order take the same next lineage;
    it differs from round to round and from a group of other members; the outer state rides along only in a
    round whose members' lineages differ (a peer that averaged alone or in another group)."""
    start = initial_lineage([torch.zeros(3), torch.ones(2)])
    members = [PeerId(bytes([i]) * 8) for i in range(4)]
    gathered = {m: {"lineage": start, "round": 5} for m in members}
    orders = [members, members[::-1], members[1:] + members[:1]]
    taken = {next_lineage(5, {m: gathered[m] for m in order}) for order in orders}
    assert len(taken) == 1
    (after,) = taken
    assert after != start and after != next_lineage(6, gathered)
    assert next_lineage(5, {m: gathered[m] for m in members[:3]}) != after  # another group, another lineage
    assert not carries_outer_state(list(gathered.values()))
    split = dict(gathered)
    split[members[3]] = {"lineage": next_lineage(4, {members[3]: gathered[members[3]]}), "round": 5}
    assert carries_outer_state(list(split.values()))
