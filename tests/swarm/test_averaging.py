"""cotrain's gradient averager.

Here, with hivemind in the test process; the rest in tests/unit/hivemind_ext/test_averaging.py."""

import threading
import time

import hivemind
import pytest
import torch

from cotrain.hivemind_ext.averaging import SwarmGradientAverager, gradient_averager_factory

pytestmark = [pytest.mark.timeout(120)]


def test_two_averagers_reading_ahead_average_exactly():
    """read_ahead travels to each AllReduceRunner's TensorPartContainer (a wrong name would fail the round),
    and the gradients come out as the mean of both peers' ones: 256 parts of 2 KiB per stream."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
    )
    factory = gradient_averager_factory({"read_ahead": 4, "part_size_bytes": 2048})
    averagers, results = [], {}
    try:
        for i, dht in enumerate((first, second)):
            param = torch.nn.Parameter(torch.zeros(128 * 1024))
            param.grad = torch.full_like(param, float(i + 1))
            averagers.append(
                factory(
                    [param],
                    dht=dht,
                    prefix="readahead_grad_averager",
                    target_group_size=2,
                    min_group_size=2,
                    min_matchmaking_time=2.0,
                    start=True,
                )
            )
        assert all(isinstance(a, SwarmGradientAverager) for a in averagers)
        assert all(a.allreduce_kwargs["prefetch"] == 4 for a in averagers)
        at = time.time() + 3.0

        def step(i: int) -> None:
            averagers[i].accumulate_grads_(batch_size=1)
            results[i] = averagers[i].step(scheduled_time=at, timeout=60)

        threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert all(results.get(i) is not None and len(results[i]) == 2 for i in range(2)), results
        for averager in averagers:
            with averager.get_tensors() as (averaged,):
                assert torch.equal(averaged, torch.full_like(averaged, 1.5))
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()


@pytest.mark.slow  # several seconds: the full suite runs it, not the daily "not slow" run
def test_the_gradient_averager_serves_no_state_and_a_newcomer_asks_none():
    """A trainer's gradient accumulators are no state to share: its averager declares nothing under its
    prefix's ``all_averagers`` key (hivemind's would, and serve a model-sized buffer to every newcomer through
    a download without a timeout to open it); newcomers (``load_state_bounded``) ask only state averagers."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    param = torch.nn.Parameter(torch.zeros(1024))
    param.grad = torch.ones_like(param)
    averager = gradient_averager_factory()([param], dht=dht, prefix="noshare_grad_averager", start=True)
    try:
        assert not averager.allow_state_sharing
        averager.state_sharing_priority = 5  # as a trainer sets it after each step
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert dht.get("noshare_grad_averager.all_averagers", latest=True) is None
            time.sleep(0.5)
    finally:
        averager.shutdown()
        dht.shutdown()
