"""The DiLoCo strategy (cotrain.strategies.diloco_rounds), on its own and in live swarms on 127.0.0.1.

Fast: the outer optimizer, the inner optimizer's initial state, the schedule's position, the settings' checks.
Slow: peers of tests/diloco_peer.py (cotrain.SwarmPeer with strategy="diloco" on a small regression model)
record what went into and out of every all-reduce and outer step; the tests recompute the average from the
peers' own pseudo-gradients and the outer step from the average, check that a client-mode peer and a newcomer
take part, that a peer killed mid-round stalls nobody past the averaging timeout, and that overlapped rounds
keep the peers' global parameters together.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, cotrain_env, wait_until
from cotrain.algorithms.lineage import (
    OUTER_STATE_EVERY,
    Voucher,
    carries_outer_state,
    fresh_lineage,
    initial_lineage,
    next_lineage,
    periodic_round,
)
from cotrain.config import RunConfig
from cotrain.hivemind_ext.diloco_state import initialize_state, outer_optimizer_factory, set_schedule

PEER = REPO / "tests" / "diloco_peer.py"
FP16_TOL = 2e-3  # relative to the pseudo-gradients' scale: what fp16 rounding of the averaged part leaves


# --- fast -------------------------------------------------------------------------------------------


def test_the_outer_state_rides_along_only_where_the_lineages_differ():
    one, other = fresh_lineage(), fresh_lineage()
    assert one != other
    assert not carries_outer_state([{"lineage": one, "round": 3}, {"lineage": one, "round": 3}])
    assert carries_outer_state([{"lineage": one, "round": 3}, {"lineage": other, "round": 3}])
    # every 10th round (9, 19, ...) against rounding drift; not the first, which has had none
    assert carries_outer_state([{"lineage": one, "round": OUTER_STATE_EVERY - 1}] * 2)
    assert not carries_outer_state([{"lineage": one, "round": 0}] * 2)
    assert not carries_outer_state([{"lineage": one, "round": OUTER_STATE_EVERY - 1}] * 2, periodic=False)
    assert carries_outer_state([{"lineage": one, "round": 3}, None])  # a member that sent nothing usable
    assert carries_outer_state([{"lineage": one, "round": 3}, {"round": 3}])


def test_peers_that_start_from_the_same_weights_start_in_the_same_lineage():
    weights = [torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(5)]
    same = [w.clone() for w in weights]
    assert initial_lineage(weights) == initial_lineage(same)
    same[0][1, 2] = torch.nextafter(same[0][1, 2], torch.tensor(1e9))  # one value, one ulp apart
    assert initial_lineage(weights) != initial_lineage(same)
    assert initial_lineage([weights[0].reshape(4, 3), weights[1]]) != initial_lineage(weights)  # the shapes


def test_the_members_of_a_group_derive_the_same_lineage():
    from hivemind.p2p import PeerID

    a, b = (PeerID(bytes([0x12, 0x20, i] + [7] * 32)) for i in (1, 2))
    gathered = {a: {"lineage": b"\x01" * 8, "round": 4}, b: {"lineage": b"\x02" * 8, "round": 4}}
    same = next_lineage(4, dict(reversed(gathered.items())))
    assert next_lineage(4, gathered) == same and len(same) == 8  # whatever order the members are listed in
    assert next_lineage(5, gathered) != same  # another round
    assert next_lineage(4, {a: gathered[a]}) != same  # another group
    assert next_lineage(4, {a: gathered[a], b: {"lineage": b"\x03" * 8}}) != same  # other histories


def test_a_round_waits_for_every_peer_not_past_it_a_record_behind_included():
    """A peer that spent its last round alone, a whole averaging timeout without a record, is at the swarm's
    round when the others read it two rounds behind: counted out, it found every group closed before it came
    (3 peers under load: a pair averaged 77 rounds at once, the third never joined one). A peer past the
    round is in a later one."""
    from cotrain.strategies.diloco_rounds import expected_members

    assert expected_members(6, [6, 2]) == 3
    assert expected_members(6, [5, 6, 0]) == 4
    assert expected_members(6, [7, 6]) == 2
    assert expected_members(0, []) == 1


def test_outer_optimizer_is_nesterov_sgd_without_weight_decay():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = outer_optimizer_factory(0.7, 0.9)([{"params": params, "weight_decay": 0.01}])
    assert isinstance(opt, torch.optim.SGD)
    group = opt.param_groups[0]
    assert (
        group["nesterov"] and group["momentum"] == 0.9 and group["lr"] == 0.7 and group["weight_decay"] == 0
    )


def test_the_inner_state_is_created_without_moving_the_parameters():
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    initialize_state(opt)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
        assert set(opt.state[p]) >= {"exp_avg", "exp_avg_sq"}
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["weight_decay"] == 0.5


def test_the_schedule_moves_to_an_inner_step():
    from transformers import get_linear_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=110)
    set_schedule(sched, 5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    set_schedule(sched, 60)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.49)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"strategy": "fedavg"}, "strategy must be one of sync, diloco"),
        ({"local_steps": 0}, "local_steps must be positive"),
        ({"outer_lr": 0.0}, "outer_lr must be positive"),
        ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
    ],
)
def test_bad_strategy_settings_are_named(values, message):
    assert any(message in p for p in RunConfig(**values).problems())


def test_a_short_run_of_dense_rounds_steps_as_fedavg_unless_told_otherwise():
    """Fewer than 100 planned rounds (--total-steps / --local-steps): lr 1 without momentum (0.5 with
    overlap); a long run keeps the paper's Nesterov step; given settings win."""
    from cotrain import cli

    def outer(*args: str) -> tuple[float, float]:
        _, config = cli.parse(["train", "--preset", "llama-tiny", "--strategy", "diloco", *args])
        return config.run.outer_lr, config.run.outer_momentum

    assert outer() == (1.0, 0.0)  # llama-tiny: 1000 inner steps, 50 a round: 20 rounds
    assert outer("--outer-overlap") == (0.5, 0.0)
    assert outer("--total-steps", "5000") == (0.7, 0.9)  # 100 rounds
    assert outer("--local-steps", "10", "--total-steps", "999") == (1.0, 0.0)
    assert outer("--outer-lr", "0.7", "--outer-momentum", "0.9") == (0.7, 0.9)
    _, config = cli.parse(["train", "--preset", "llama-tiny"])  # sync: no outer step
    assert (config.run.outer_lr, config.run.outer_momentum) == (0.7, 0.9)


def test_the_api_refuses_a_bad_strategy_before_the_network_starts():
    import cotrain
    from cotrain.errors import UserError

    with pytest.raises(UserError, match="strategy must be one of"):
        cotrain.SwarmPeer(
            torch.nn.Linear(2, 2),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            run_id="diloco-api",
            target_batch_size=8,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            strategy="fedavg",
        )


# --- what a newcomer takes from its donor, and whom a group's choice leaves out ---------------------


def peer_ids(n: int) -> list:
    from hivemind.p2p import PeerID

    return [PeerID(bytes([0x12, 0x20, i] + [7] * 32)) for i in range(1, n + 1)]


class FakeDHT:
    """A DHT's ``get`` over fixed records (key -> subkey -> value), as hivemind returns them."""

    def __init__(self, peer_id, records: dict) -> None:
        self.peer_id, self.records = peer_id, records

    def get(self, key, latest=True):
        from hivemind.utils.timed_storage import ValueWithExpiration

        found = self.records.get(key)
        if found is None:
            return None
        return ValueWithExpiration({k: ValueWithExpiration(v, 1e12) for k, v in found.items()}, 1e12)


def diloco_holder(local_steps: int = 4, momentum: float = 0.9, seed: int = 0):
    """A DiLoCoStateAverager's downloading side without its averager (no DHT, no process): its outer optimizer
    over two global parameters, with momentum buffers."""
    from types import SimpleNamespace

    from cotrain.hivemind_ext.diloco_state import DiLoCoStateAverager

    g = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(40, 8, generator=g)),
        torch.nn.Parameter(torch.randn(8, generator=g)),
    ]
    holder = DiLoCoStateAverager.__new__(DiLoCoStateAverager)
    holder._parent_pid = None  # no averager process to stop when it is collected
    holder.optimizer = outer_optimizer_factory(0.7, momentum)([{"params": params}])
    for p in params:
        holder.optimizer.state[p]["momentum_buffer"] = torch.randn(p.shape, generator=g) if momentum else None
        if not momentum:
            holder.optimizer.state.pop(p)
    holder.pinned_momentum = (
        [holder.optimizer.state[p]["momentum_buffer"] for p in params] if momentum else []
    )
    holder._outer_layout = holder.optimizer.state_dict()
    holder.extra_tensors, holder.local_steps, holder.prefix = (), local_steps, "run_state_averager"
    holder.suspects, holder.unreachable, holder._held = {}, {}, SimpleNamespace(value=-1.0)
    holder.public_key, holder.progress_key, holder.witnessed_key = b"[owner:me]", None, "run_progress"
    holder._matchmaking = SimpleNamespace(group_key_manager=SimpleNamespace(prefix=holder.prefix))
    return holder


def served(holder, epoch: int, inner_steps: int | None = None, lineage: bytes | None = None, **changes):
    """What a donor holding ``holder``'s outer state serves at round ``epoch`` (``changes``: in its
    metadata)."""
    from hivemind.optim.state_averager import dump_optimizer_state

    params = [p.detach().clone() for p in holder.global_parameters]
    meta, statistics = dump_optimizer_state(holder.optimizer)
    metadata = dict(
        epoch=epoch,
        strategy="diloco",
        optimizer_metadata=meta,
        outer_tensors=len(params) + len(statistics),
        inner_metadata=[],
        inner_steps=epoch * holder.local_steps if inner_steps is None else inner_steps,
    )
    if lineage is not None:
        metadata["lineage"] = lineage
    metadata.update(changes)
    return metadata, [*params, *(t.clone() for t in statistics)]


def progress(peer, epoch: int) -> dict:
    return dict(
        peer_id=peer.to_bytes(), epoch=epoch, samples_accumulated=0, samples_per_second=1.0, time=1.0,
        client_mode=False,
    )  # fmt: skip


def download(holder, donors: dict, records: dict):
    """``holder``'s download (cotrain.hivemind_ext.statecheck) from ``donors`` (peer -> (priority, served
    state)), with the DHT's ``records``: the state it would load, or None."""
    import asyncio
    import concurrent.futures

    me = peer_ids(9)[-1]
    key = f"{holder.prefix}.all_averagers"
    holder.dht = FakeDHT(me, {key: {p.to_bytes(): prio for p, (prio, _) in donors.items()}, **records})
    by_id = {p.to_base58(): state for p, (_, state) in donors.items()}

    async def from_donor(peer, chunk_timeout, timeout):
        return by_id[peer.to_base58()]

    holder._download_bounded = from_donor
    future = concurrent.futures.Future()
    asyncio.run(holder.download_state(future, None))
    return future.result(0)


def test_a_served_state_at_round_2_to_the_60_is_refused_and_the_next_donor_asked(caplog):
    """A donor on the unverified fallback (nobody published a fingerprint for its step) that serves round
    2^60 is refused with one line and asked last; the next donor's state is loaded. The round is bounded by
    the largest that two other peers' progress records reach (by MAX_ROUND where fewer than two report). An
    inner step outside its round is no reason to refuse a state: the load takes it only within the round."""
    import logging

    from cotrain.hivemind_ext.diloco_state import MAX_ROUND, ROUND_SLACK, round_refusal

    liar, honest, a, b = peer_ids(4)
    holder = diloco_holder(local_steps=4)
    records = {"run_progress": {a.to_bytes(): progress(a, 5), b.to_bytes(): progress(b, 5)}}
    caplog.set_level(logging.INFO, logger="cotrain.hivemind_ext.statecheck")
    for bad in (served(holder, 2**60),):
        holder.suspects = {}
        donors = {liar: (max(6.0, bad[0]["epoch"]), bad), honest: (5.0, served(holder, 5))}  # the liar first
        loaded = download(holder, donors, records)
        assert loaded is not None and loaded[0]["epoch"] == 5 and loaded[0]["inner_steps"] == 20
        assert liar.to_base58() in holder.suspects and honest.to_base58() not in holder.suspects
        refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"Peer {liar}")]
        assert len(refusals) == 1 and "not loading it, trying another peer" in refusals[0], refusals
        caplog.clear()
    # alone, it is refused too: no state is loaded, even where no other peer's progress is read
    assert download(holder, {liar: (2.0**60, served(holder, 2**60))}, records) is None
    assert download(holder, {liar: (2.0**60, served(holder, 2**60))}, {}) is None
    # its own progress record is no witness of its round: one record alone, or beside an honest one
    alone = {"run_progress": {liar.to_bytes(): progress(liar, 2**60)}}
    lying = {"run_progress": {**alone["run_progress"], a.to_bytes(): progress(a, 5)}}
    for claims in (alone, lying):
        assert download(holder, {liar: (2.0**60, served(holder, 2**60))}, claims) is None
    # an honest donor ahead of a peer that lags is within the slack of what the two reach
    lagging = {"run_progress": {honest.to_bytes(): progress(honest, 7), a.to_bytes(): progress(a, 5)}}
    assert download(holder, {honest: (7.0, served(holder, 7))}, lagging)[0]["epoch"] == 7
    # the decision: the round within ROUND_SLACK of the witnessed one; any inner step (a resumed monitor's
    # copy serves 0), which the load takes only within the round's range
    assert round_refusal(5 + ROUND_SLACK, (5 + ROUND_SLACK) * 4, 5, 4) is None
    assert "beyond the round" in round_refusal(6 + ROUND_SLACK, (6 + ROUND_SLACK) * 4, 5, 4)
    assert round_refusal(5, 0, 5, 4) is None and round_refusal(5, 10**9, 5, 4) is None
    assert round_refusal(MAX_ROUND, MAX_ROUND * 4, None, 4) is None
    assert "beyond any run" in round_refusal(MAX_ROUND + 1, (MAX_ROUND + 1) * 4, None, 4)
    for epoch, steps in ((True, 4), (-1, 0), (5.0, 20)):  # not a round
        assert round_refusal(epoch, steps, 5, 4) is not None, (epoch, steps)


def attesting(holder, epoch: int, lineage: bytes, peer: str, momentum_shift: float = 0.0):
    """Another holder's published record of ``holder``'s state at ``epoch``, attesting ``lineage`` (its
    momentum moved by ``momentum_shift``)."""
    from cotrain.hivemind_ext import statecheck as sc

    params = holder.global_parameters
    momentum = [holder.optimizer.state[p]["momentum_buffer"] + momentum_shift for p in params]
    record = sc.step_record(sc.fingerprint(params, epoch), lineage, sc.fingerprint(momentum, epoch))
    parsed = sc.StepFingerprint.parse_obj(record.dict())
    return sc.Published(peer, {epoch: parsed.fingerprint()}, {epoch: parsed.attestation()})


def test_a_newcomer_keeps_its_donors_lineage_only_where_another_peer_attests_it_for_that_state(caplog):
    """The lineage a donor serves is kept only where another peer's record for that round attests it, and the
    state (global parameters and momentum) matches every such record; a poisoned momentum, the donor's own
    word, another lineage or a record that disagrees: a fresh lineage (the first round carries the state)."""
    import logging

    group, other = fresh_lineage(), fresh_lineage()
    holder = diloco_holder()
    donor, peer, third = "QmDonor", "QmPeer", "QmThird"

    def kept(records: dict, state=None) -> bool:
        loaded = state or served(holder, 5, lineage=group)
        holder.settle_download(donor, loaded, records)
        return loaded[0].get("lineage") == group

    caplog.set_level(logging.INFO, logger="cotrain.hivemind_ext.diloco_state")
    assert kept({"k1": attesting(holder, 5, group, peer)})
    assert not kept({})  # the donor's word alone
    assert "this peer starts a fresh one" in caplog.text
    assert not kept({"k1": attesting(holder, 5, group, donor)})  # its own record is its word too
    assert not kept({"k1": attesting(holder, 5, other, peer)})  # another lineage
    assert not kept({"k1": attesting(holder, 4, group, peer)})  # another round
    assert not kept({"k1": attesting(holder, 5, group, peer, momentum_shift=1.0)})  # the momentum differs
    disagree = {"k1": attesting(holder, 5, group, peer), "k2": attesting(holder, 5, group, third, 1.0)}
    assert not kept(disagree)  # every peer that attests the lineage must hold the state
    # a poisoned momentum served under the group's lineage: the global parameters match, the momentum not
    poisoned = served(holder, 5, lineage=group)
    n = len(holder.global_parameters)
    for t in poisoned[1][n:]:
        t.mul_(-50.0)
    assert not kept({"k1": attesting(holder, 5, group, peer)}, poisoned)
    garbled = served(holder, 5, lineage=group, optimizer_metadata=[{"type": "tensor", "index": 99}])
    assert not kept({"k1": attesting(holder, 5, group, peer)}, garbled)
    # a run without momentum: the global parameters alone are attested
    plain = diloco_holder(momentum=0.0)
    record = attesting(diloco_holder(momentum=0.9), 5, group, peer)
    loaded = served(plain, 5, lineage=group)
    plain.settle_download(donor, loaded, {"k1": record})
    assert "lineage" not in loaded[0]  # a record with a momentum does not match a state without
    from cotrain.hivemind_ext import statecheck as sc

    params = plain.global_parameters
    bare = sc.StepFingerprint.parse_obj(sc.step_record(sc.fingerprint(params, 5), group).dict())
    loaded = served(plain, 5, lineage=group)
    plain.settle_download(
        donor, loaded, {"k1": sc.Published(peer, {5: bare.fingerprint()}, {5: bare.attestation()})}
    )
    assert loaded[0]["lineage"] == group


def test_a_holder_attests_the_lineage_it_vouches_for_with_its_momentum():
    """A DiLoCo holder's record attests its lineage and momentum where it vouches for its state (the same
    round and values), nothing otherwise; the record's schema reads it back and refuses a bad momentum."""
    import threading

    from cotrain.hivemind_ext import statecheck as sc

    holder = diloco_holder()
    holder.lock_averaged_tensors = threading.Lock()
    voucher, lineage = Voucher(2), fresh_lineage()
    holder.served_lineage = voucher.served
    params = holder.global_parameters
    assert holder.attestation(5, params) is None  # nothing vouched for
    voucher.vouch(5, lineage, params)
    attested, momentum = holder.attestation(5, params)
    assert attested == lineage and all(
        m is holder.optimizer.state[p]["momentum_buffer"] for m, p in zip(momentum, params, strict=True)
    )
    assert holder.attestation(6, params) is None
    record = sc.step_record(sc.fingerprint(params, 5), lineage, sc.fingerprint(momentum, 5))
    back = sc.StepFingerprint.parse_obj(record.dict()).attestation()
    assert back.lineage == lineage and sc.distance(back.momentum, sc.fingerprint(momentum, 5)) < 1e-6
    old = sc.StepFingerprint.parse_obj(
        {k: v for k, v in record.dict().items() if k not in ("lineage", "momentum")}
    )
    assert old.attestation() is None  # a record without one (an older peer's, a sync holder's)
    for bad in ({"lineage": b"short"}, {"momentum": record.momentum[:-4]}, {"momentum": record.momentum * 3}):
        with pytest.raises(ValueError):
            sc.StepFingerprint.parse_obj({**record.dict(), **bad})


def test_a_peer_that_breaks_its_lineage_round_after_round_is_struck():
    """A member of a whole round should show, in its next round, the lineage that round gave the group; one
    that shows another in LINEAGE_BREAKS of its last LINEAGE_WINDOW watched rounds is struck. An honest break
    now and then, a partial round, a member not met again: nobody struck."""
    from cotrain.algorithms.lineage import LINEAGE_BREAKS, LINEAGE_WINDOW, MAX_STRUCK, LineageWatch

    me, honest, liar = peer_ids(3)
    watch = LineageWatch()
    lineage = fresh_lineage()
    struck_at = []
    for r in range(3 * LINEAGE_WINDOW):
        broke = r % LINEAGE_WINDOW == 1  # once per window: the honest peer's bad luck
        gathered = {
            me: {"lineage": lineage, "round": r},
            honest: {"lineage": fresh_lineage() if broke else lineage, "round": r},
            liar: {"lineage": fresh_lineage(), "round": r},
        }
        lineage = next_lineage(r, gathered)
        for peer in watch.observe(me, r, gathered, lineage):
            struck_at.append((peer, r))
    assert struck_at == [(liar, LINEAGE_BREAKS)]  # its breaks are watched from round 1 on
    assert watch.struck() == [liar.to_bytes()] and not watch.strikes(honest)
    # a partial round here gives no expectation; a member met again later than the next round is not judged
    watch = LineageWatch()
    for r, partial in ((0, True), (1, False), (3, False), (4, False)):
        gathered = {me: {"lineage": b"m" * 8, "round": r}, liar: {"lineage": fresh_lineage(), "round": r}}
        assert watch.observe(me, r, gathered, None if partial else next_lineage(r, gathered)) == []
    assert [watch.strikes(liar), len(watch.history[liar])] == [False, 1]  # judged at round 4 only
    assert len(watch.struck()) <= MAX_STRUCK


def test_a_group_leaves_out_the_lineage_of_a_member_most_others_strike():
    """The same choice on every member: a member struck by a strict majority of the others does not make its
    group carry the outer state; one liar cannot discount an honest member of a larger group."""
    from cotrain.algorithms.lineage import MAX_STRUCK, discounted

    a, b, x = peer_ids(3)
    group = fresh_lineage()

    def member(lineage, *struck, round_=3):
        return {
            "lineage": lineage,
            "round": round_,
            **({"struck": [p.to_bytes() for p in struck]} if struck else {}),
        }

    fresh = {a: member(group, x), b: member(group, x), x: member(fresh_lineage())}
    assert discounted(fresh) == {x} and not carries_outer_state(fresh)
    assert carries_outer_state(list(fresh.values()))  # unnamed members: every lineage counts
    assert carries_outer_state({**fresh, b: member(group)})  # only a half of the others strike it: it counts
    diverged = {a: member(fresh_lineage()), b: member(group), x: member(fresh_lineage(), a)}
    assert discounted(diverged) == set() and carries_outer_state(diverged)  # a lone liar strikes nobody
    pair = {a: member(group, x), x: member(fresh_lineage(), a)}
    assert discounted(pair) == {a, x} and not carries_outer_state(pair)  # in a pair the other's word decides
    assert carries_outer_state({a: member(group, x), x: member(fresh_lineage())}, periodic=True) is False
    periodic = {
        a: member(group, x, round_=OUTER_STATE_EVERY - 1),
        x: member(fresh_lineage(), round_=OUTER_STATE_EVERY - 1),
    }
    assert carries_outer_state(periodic)  # the periodic rounds of dense rounds stay
    garbage = {a: {**member(group), "struck": "x" * 100}, b: member(group), x: member(fresh_lineage())}
    assert carries_outer_state(garbage)  # a malformed list strikes nobody
    flood = {a: {**member(group), "struck": [b"?"] * MAX_STRUCK + [x.to_bytes()]}, b: member(group, x)}
    assert discounted({**flood, x: member(fresh_lineage())}) == set()  # names past MAX_STRUCK are not read


def test_a_member_fresh_every_round_makes_its_group_carry_the_state_only_until_it_is_struck(caplog):
    """Two honest peers (each a DiLoCoOptimizer's bookkeeping: what it sends, what it notes after a round) and
    one that shows a fresh lineage every round: their group carries the outer state in its first rounds only,
    then never again for its sake; each honest peer names it once in a warning."""
    import logging
    from types import SimpleNamespace

    from cotrain.algorithms.lineage import LINEAGE_BREAKS, LineageWatch
    from cotrain.strategies.diloco_rounds import DiLoCoOptimizer

    caplog.set_level(logging.WARNING, logger="cotrain.strategies.diloco_rounds")
    a, b, x = peer_ids(3)
    honest = []
    for peer in (a, b):
        opt = DiLoCoOptimizer.__new__(DiLoCoOptimizer)
        opt.dht, opt.lineage, opt.lineage_watch = SimpleNamespace(peer_id=peer), b"\x00" * 8, LineageWatch()
        opt.state_averager = SimpleNamespace(local_epoch=0)
        honest.append(opt)
    carried = []
    for r in range(30):
        for opt in honest:
            opt.state_averager.local_epoch = r
        gathered = {
            a: honest[0]._gather(),
            b: honest[1]._gather(),
            x: {"lineage": fresh_lineage(), "round": r},
        }
        if carries_outer_state(gathered, periodic=False):
            carried.append(r)
        for opt in honest:
            opt.lineage = next_lineage(r, gathered)
            opt._watch_lineages(gathered, opt.lineage)
    assert carried == list(range(LINEAGE_BREAKS + 1)), carried  # round 0, then each break until struck
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(f"Peer {x} showed a lineage" in w for w in warnings), warnings


# --- live -------------------------------------------------------------------------------------------


class Peer:
    """tests/diloco_peer.py in a process of its own, writing its JSON lines to ``out``."""

    def __init__(self, tmp: Path, name: str, *args: str):
        self.out = tmp / f"{name}.jsonl"
        self.read: list[dict] = []  # the rows read so far, up to byte ``self.offset`` of ``out``
        self.offset = 0
        self.log = open(tmp / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "--out", str(self.out), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=cotrain_env(),
            start_new_session=True,
        )

    def rows(self, event: str | None = None) -> list[dict]:
        """Its rows so far (of ``event``). Only the lines added since the last call are read: a round's rows
        carry whole vectors, and the waits poll every half second."""
        if self.out.exists():
            with open(self.out, "rb") as f:
                f.seek(self.offset)
                added = f.read()
            complete = added[: added.rfind(b"\n") + 1]  # a last line still being written waits
            self.offset += len(complete)
            self.read += [json.loads(line) for line in complete.splitlines() if line.strip()]
        return [r for r in self.read if event is None or r["event"] == event]

    def address(self, timeout: float = 60) -> list[str]:
        return wait_until(lambda: self.rows("ready"), timeout, what=f"{self.out.stem} to start")[0]["maddrs"]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]


@pytest.fixture
def peers(tmp_path):
    started: list[Peer] = []

    def start(name: str, *args: str) -> Peer:
        started.append(Peer(tmp_path, name, *args))
        return started[-1]

    yield start
    for peer in started:
        peer.kill()
        peer.log.close()


def by_round(peer: Peer, event: str) -> dict[int, dict]:
    return {r["round"]: r for r in peer.rows(event)}


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


def joint_rounds(members: list[Peer]) -> list[int]:
    """Rounds in which every member averaged in a group of them all, and whole (a part that timed out on a
    loaded machine leaves the members apart by design until a later round carries the outer state)."""
    averages = [by_round(p, "average") for p in members]  # each file read once: its rows are large
    common = set.intersection(*(set(a) for a in averages))
    return [
        r
        for r in sorted(common)
        if all(a[r]["size"] == len(members) and not a[r]["partial"] for a in averages)
    ]


@pytest.mark.slow
@pytest.mark.timeout(300)
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
@pytest.mark.timeout(360)
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
@pytest.mark.timeout(360)
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


def test_a_served_state_carries_the_lineage_its_holder_vouched_for_and_no_other():
    """A holder vouches for its global parameters after a round, a download or a resume; a state served at
    that round with the same values carries its lineage. Another round, values written since (a restored
    backup), a round in progress (the outer step drops the vouch) or overlapped rounds: no lineage."""
    import threading
    from types import SimpleNamespace

    from cotrain.strategies.diloco_rounds import DiLoCoOptimizer

    params = [torch.randn(10, 4), torch.randn(7)]
    opt = DiLoCoOptimizer.__new__(DiLoCoOptimizer)
    opt.state_averager = SimpleNamespace(
        lock_averaged_tensors=threading.Lock(), global_parameters=params, local_epoch=3
    )
    opt.parameters, opt.overlap, opt.lineage, opt.voucher = params, False, fresh_lineage(), Voucher(2)
    assert opt.voucher.served(3, params) is None  # nothing vouched for yet
    opt._vouch()
    served = [p.clone() for p in params]
    assert opt.voucher.served(3, served) == opt.lineage
    assert opt.voucher.served(3, [*served, torch.zeros(3)]) == opt.lineage  # the optimizer's tensors follow
    assert opt.voucher.served(2, served) is None and opt.voucher.served(3, served[:1]) is None
    opt.voucher.withdraw()  # an outer step under way
    assert opt.voucher.served(3, served) is None
    opt._vouch()
    params[0].add_(1.0)  # written from outside since
    assert opt.voucher.served(3, [p.clone() for p in params]) is None
    opt.overlap, opt.voucher, opt.state_averager.global_parameters = True, Voucher(2), served
    opt._vouch()  # with overlap it vouches for nothing
    assert opt.voucher.served(3, served) is None


@pytest.mark.timeout(120)
def test_the_global_parameters_are_a_diloco_peers_nan_backup():
    # DiLoCo's NaN guard keeps no copy of the state (cotrain.engine.backup): the global parameters move only
    # by finite outer steps, and a model gone non-finite restarts its round from them
    import cotrain
    from cotrain.engine.parts import NanGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    peer = cotrain.SwarmPeer(
        model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        run_id="diloco-nan-backup",
        target_batch_size=2,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        strategy="diloco",
        local_steps=2,
        backup_every_steps=1,
        matchmaking_time=1.0,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    try:
        (guard,) = [p.guard for p in peer.parts if isinstance(p, NanGuard)]
        opt = peer.strategy.opt
        glob = opt.state_averager.global_parameters
        for _ in range(8):  # rounds of 2 inner steps of 2 samples
            model(torch.randn(2, 4)).pow(2).mean().backward()
            peer.step(batch_size=2)
        assert peer.global_step >= 2 and guard.step is not None
        assert guard.params == [] and guard.optimizer_state is None  # no copy kept
        assert all(p.grad is None for p in glob)  # the outer step lends the average; no buffer between rounds
        with opt.outer_averager.get_tensors() as tensors:  # rounds average the outer state's own tensors
            state = tensors[opt.changes :]
        carried = opt._carried_state()  # the global parameters, then the momentum: the same tensors all along
        assert len(carried) == 2 * len(glob) and carried[len(glob)].abs().sum() > 0
        assert [t.data_ptr() for t in state] == [t.data_ptr() for t in carried]
        assert carried[len(glob) :] == opt.state_averager.pinned_momentum
        before = [p.detach().clone() for p in glob]
        # a non-finite average is not applied: the global parameters stay (the next round carries the state)
        opt._outer_step([torch.full_like(p, float("nan")) for p in glob], None)
        assert all(torch.equal(a, b) for a, b in zip(before, glob, strict=True))
        with torch.no_grad():
            model.weight.fill_(float("nan"))
        assert guard.after_global_step()  # restored: the model from the global parameters, the round anew
        assert guard.restores == 1 and opt.samples == 0
        assert all(torch.equal(m, g) for m, g in zip(model.parameters(), glob, strict=True))
    finally:
        peer.shutdown()
