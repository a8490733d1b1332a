"""What the swarm's progress counts when peers lie about theirs (cotrain.hivemind_ext.progress).

Here, with hivemind in the test process; the rest in tests/unit/hivemind_ext/test_progress.py."""

from __future__ import annotations


def test_every_round_of_the_trainers_averagers_passes_the_watch():
    # cotrain.hivemind_ext.liveness: WatchedRounds sees a round only when it sits after every hivemind
    # averager class above DecentralizedAverager (only the hook base between) and hivemind begins both kinds
    # of round through super().step (a guard against a change upstream)
    import inspect

    from hivemind.averaging import DecentralizedAverager
    from hivemind.optim.grad_averager import GradientAverager

    from cotrain.hivemind_ext.averaging import SwarmGradientAverager
    from cotrain.hivemind_ext.hooks import Averager
    from cotrain.hivemind_ext.liveness import WatchedRounds
    from cotrain.hivemind_ext.manifest import source_of
    from cotrain.hivemind_ext.outer import OuterAverager
    from cotrain.hivemind_ext.statecheck import CheckedTrainingStateAverager

    for cls in (SwarmGradientAverager, CheckedTrainingStateAverager, OuterAverager):
        mro = cls.__mro__
        assert mro[mro.index(DecentralizedAverager) - 2 :][:2] == (WatchedRounds, Averager), mro
    assert "super().step(" in inspect.getsource(GradientAverager.schedule_step)
    assert "super().step(" in source_of("hivemind.optim.state_averager.TrainingStateAverager._do")


def test_a_paced_tracker_stores_a_record_per_pace_the_last_one_late_and_a_new_round_at_once():
    """DiLoCo's tracker (pace): reports within the pace wait for its end, one store for all of them, with the
    newest samples; a new epoch is stored at once; unpaced, every report is stored."""
    import time

    import hivemind

    from cotrain.hivemind_ext.progress import PacedSignal, SwarmProgressTracker

    signal = PacedSignal(0.3)
    signal.set()
    assert signal.is_set()  # the first one takes effect at once
    signal.clear()
    signal.set()
    signal.set()
    assert not signal.is_set()
    time.sleep(0.5)
    assert signal.is_set()  # at the pace's end, once
    signal.clear()
    signal.now()
    assert signal.is_set()

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    stored: list[dict] = []
    store = dht.store

    def counting(key, value=None, *args, **kwargs):
        if isinstance(key, str) and key.endswith("_progress") and value is not None:
            stored.append(value)
        return store(key, value, *args, **kwargs)

    dht.store = counting
    try:
        paced = SwarmProgressTracker(dht=dht, prefix="paced", target_batch_size=10**6, pace=4.0, start=True)
        time.sleep(0.3)
        stored.clear()
        for samples in range(1, 11):  # ten inner steps within the pace
            paced.report_local_progress(0, samples * 8)
            time.sleep(0.02)
        time.sleep(0.2)
        assert len(stored) <= 1
        # the newest, once the pace is over
        assert until(lambda: stored and stored[-1]["samples_accumulated"] == 80, timeout=10)
        count = len(stored)
        paced.report_local_progress(1, 0)  # a new round
        assert until(lambda: len(stored) == count + 1, timeout=3) and stored[-1]["epoch"] == 1
        paced.shutdown()

        unpaced = SwarmProgressTracker(dht=dht, prefix="unpaced", target_batch_size=10**6, start=True)
        time.sleep(0.3)
        stored.clear()
        for samples in range(1, 6):
            unpaced.report_local_progress(0, samples * 8)
            time.sleep(0.1)
        assert until(lambda: len(stored) >= 2)  # hivemind's pace: a store per report (a loaded reporter may
        # take two at once)
        unpaced.shutdown()
    finally:
        dht.shutdown()


def until(condition, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
