"""The DiLoCo strategy (cotrain.strategies.diloco_rounds), on its own and in live swarms on 127.0.0.1.

Here, in the test process alone; the rest in tests/live/test_diloco.py and tests/swarm/test_diloco.py."""

from __future__ import annotations

import pytest
import torch

from cotrain.algorithms.lineage import (
    OUTER_STATE_EVERY,
    Voucher,
    carries_outer_state,
    fresh_lineage,
    initial_lineage,
    next_lineage,
)
from cotrain.config import RunConfig
from cotrain.hivemind_ext.diloco_state import initialize_state, outer_optimizer_factory, set_schedule
from support.diloco import peer_ids


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
