"""The DiLoCo strategy (cotrain.strategies.diloco_rounds), on its own and in live swarms on 127.0.0.1.

Here, with hivemind in the test process; the rest in tests/live/test_diloco.py and
tests/unit/strategies/test_diloco.py."""

from __future__ import annotations

import pytest
import torch

from cotrain.algorithms.lineage import (
    Voucher,
    fresh_lineage,
)
from cotrain.hivemind_ext.diloco_state import outer_optimizer_factory
from support.diloco import peer_ids, served


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
