"""What the swarm's progress counts when peers lie about theirs (cotrain.hivemind_ext.progress).

Here, in the test process alone; the rest in tests/swarm/test_progress.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from hivemind.utils import ValueWithExpiration, get_dht_time

from cotrain.hivemind_ext.progress import (
    PROGRESS_CAP,
    RobustProgressTracker,
    capped,
    robust_epoch,
    witnessed_epoch,
)


def test_a_lone_peer_far_ahead_does_not_move_the_swarm():
    assert robust_epoch(5, [5, 5, 5, 10**6]) == 5
    assert robust_epoch(5, [5, 5, 6]) == 6  # the first peer to finish the step: the swarm's next epoch
    assert robust_epoch(5, [5, 9, 9]) == 9  # two peers beyond: this peer is behind
    assert robust_epoch(5, [5, 8, 9]) == 8  # two peers at 8 or beyond
    assert robust_epoch(5, []) == 5


def test_the_witnessed_epoch_is_one_that_two_other_peers_reached():
    assert witnessed_epoch([16, 19]) == 16  # an honest peer and a liar that ran ahead
    assert witnessed_epoch([16, 17, 40]) == 17
    assert witnessed_epoch([50]) == 50  # a newcomer beside a single peer takes its epoch
    assert witnessed_epoch([]) is None


def test_claims_count_at_most_twice_the_median():
    assert capped([10, 12, 11, 9, 1e6]) == [10, 12, 11, 9, PROGRESS_CAP * 11]
    assert capped([]) == []


def tracker(local_epoch: int, target: int) -> RobustProgressTracker:
    """A RobustProgressTracker's parsing state without its DHT and threads: what parsing reads."""
    t = object.__new__(RobustProgressTracker)
    t.local_progress = SimpleNamespace(epoch=local_epoch, samples_accumulated=0)
    t.performance_ema = SimpleNamespace(eps=1e-9, samples_per_second=1.0)
    t.target_batch_size, t.prefix, t.status_loglevel = target, "run", logging.DEBUG
    t.expected_drift_peers, t.expected_drift_rate = 3, 0.2
    t.min_refresh_period, t.max_refresh_period, t.default_refresh_period = 0.5, 10.0, 3.0
    return t


def records(*peers: tuple[int, int, float]) -> dict:
    now = get_dht_time()
    return {
        f"peer{i}".encode(): ValueWithExpiration(
            dict(
                peer_id=f"peer{i}".encode(),
                epoch=epoch,
                samples_accumulated=samples,
                samples_per_second=rate,
                time=now,
                client_mode=False,
            ),
            now + 60,
        )
        for i, (epoch, samples, rate) in enumerate(peers)
    }


def test_an_inflated_report_does_not_trigger_the_step():
    honest = [(3, 100, 10.0)] * 4
    progress = tracker(3, target=1000)._parse_swarm_progress_data(records(*honest, (3, 10**9, 1e6)))
    assert progress.epoch == 3
    assert progress.samples_accumulated == 4 * 100 + PROGRESS_CAP * 100  # not a billion
    assert progress.samples_accumulated < progress.target_batch_size
    assert progress.eta_next_epoch > get_dht_time() + 5  # its samples/s are capped too
    # an epoch claimed by one peer alone is ignored
    progress = tracker(3, target=1000)._parse_swarm_progress_data(records(*honest, (10**6, 10, 10.0)))
    assert progress.epoch == 3 and progress.samples_accumulated == 400


def test_a_peer_still_at_the_previous_epoch_counts_in_the_median():
    # two honest peers, one of them still at epoch 2, and a liar at 3: the median of the epoch's reports is
    # not half the liar's claim (the honest peer at 3 has 8 samples, the lagging one 0 for epoch 3)
    reports = records((3, 8, 10.0), (2, 40, 10.0), (3, 8000, 10.0))
    progress = tracker(3, target=96)._parse_swarm_progress_data(reports)
    assert progress.epoch == 3 and progress.samples_accumulated == 8 + PROGRESS_CAP * 8


def test_a_round_every_other_peer_has_gone_past_ends_at_once_without_waiting_for_its_timeout():
    """DiLoCo's straggler: the others finished its round (their records are at the next one), so its round's
    group can never form; the round watch cancels the round that still looks for it."""
    from cotrain.hivemind_ext.liveness import RoundWatch
    from cotrain.hivemind_ext.progress import SwarmProgressTracker

    t = object.__new__(SwarmProgressTracker)
    t.dht, t._gone = SimpleNamespace(peer_id=SimpleNamespace(to_bytes=lambda: b"peer0")), {}
    t._last_metadata = records((3, 0, 1.0), (4, 8, 1.0), (4, 0, 1.0))  # this peer at 3, the others at 4
    assert t.passed_by(3) and not t.passed_by(4) and t.others_at() == 4 and t.ahead_of(3) == 4
    t._last_metadata = records((3, 0, 1.0), (4, 8, 1.0), (3, 16, 1.0))  # a third still in round 3
    assert not t.passed_by(3) and t.others_at() == 3 and t.ahead_of(3) is None
    t._gone = {b"peer2": 0.0}  # ... but found gone: left out
    assert t.passed_by(3) and t.ahead_of(3) == 4
    t._gone, t._last_metadata = {}, records((3, 0, 1.0))  # alone: nobody went past it
    assert not t.passed_by(3) and t.others_at() is None and t.ahead_of(3) is None
    # several rounds ahead: joined where two peers went, never where one alone says it is
    t._last_metadata = records((3, 0, 1.0), (9, 8, 1.0), (7, 0, 1.0))
    assert t.ahead_of(3) == 7 and t.ahead_of(7) is None  # (one of them is still in round 7)
    t._last_metadata = records((3, 0, 1.0), (1000, 8, 1.0))
    assert t.passed_by(3) and t.ahead_of(3) is None and t.ahead_of(999) == 1000

    cancelled = []
    control = SimpleNamespace(done=lambda: bool(cancelled), cancel=lambda: cancelled.append(True))
    averager = SimpleNamespace(rounds_looking_for_group=lambda _: [control])
    watch = RoundWatch([averager], t, None, 1.0, lambda: False, left_behind=lambda: True)
    assert watch.look() == 1 and cancelled


def test_a_peer_the_others_left_behind_joins_their_round_with_the_steps_it_took():
    """A DiLoCo round this peer ended alone while the others went on (it joined as their round ended): once it
    has read the swarm since, it moves to the others' round at once, keeping this round's samples and inner
    steps, instead of staying a round behind them for good (hivemind's swarm epoch leaves client-mode peers
    out, so a swarm of clients never says so)."""
    import contextlib
    import threading

    import torch

    from cotrain.strategies.diloco_rounds import DiLoCoOptimizer

    calls: list = []
    ahead = [5]
    tracker = SimpleNamespace(
        fetched_global_progress_this_epoch=threading.Event(),
        ahead_of=lambda epoch: ahead[0] if ahead[0] is not None and ahead[0] > epoch else None,
        pause_updates=contextlib.nullcontext,
        update_epoch=lambda new_epoch: calls.append(("epoch", new_epoch)),
        report_local_progress=lambda epoch, samples: calls.append(("report", epoch, samples)),
        fetch_now=lambda: calls.append("fetch"),
    )
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (1 + step))
    opt = DiLoCoOptimizer.__new__(DiLoCoOptimizer)
    opt.tracker, opt.client_mode, opt.local_steps = tracker, False, 2
    opt.state_averager = SimpleNamespace(
        local_epoch=3,
        inner_steps=6,
        lock_inner=threading.Lock(),
        inner_scheduler=schedule,
        state_sharing_priority=3,
    )
    opt.samples, opt.inner_steps_this_round, opt._rejoining = 8, 1, False
    opt._rejoin()  # its last round was not alone
    opt._rejoining = True
    opt._rejoin()  # not read since
    assert opt.local_epoch == 3 and not calls and opt._rejoining
    tracker.fetched_global_progress_this_epoch.set()
    opt._rejoin()
    assert opt.local_epoch == 5 and opt.state_averager.state_sharing_priority == 5 and not opt._rejoining
    assert (
        opt.inner_steps == 11 and schedule.last_epoch == 11
    )  # 5 rounds of 2 inner steps, and the one it took
    assert calls == [("epoch", 5), ("report", 5, 8), "fetch"]  # its samples count in the round it joins
    calls.clear()
    opt._rejoining = True
    opt._rejoin()  # the others are not ahead of it: it stays
    ahead[0] = None
    opt._rejoining = True
    opt._rejoin()  # nobody else: it stays
    assert opt.local_epoch == 5 and not calls
