"""A peer's DHT and averagers served from threads of its process (cotrain.hivemind_ext.hosting), or from
processes of their own (``--swarm-processes``).

Here, with hivemind in the test process; the rest in tests/live/test_hosting.py and
tests/unit/hivemind_ext/test_hosting.py."""

from __future__ import annotations

import logging
import time

import psutil
import pytest
import torch
from hivemind.averaging import DecentralizedAverager

from cotrain.algorithms.aggregation import build
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.reducers import RobustAveraging


class Averager(ServedInThread, RobustAveraging, DecentralizedAverager):
    def __init__(self, *args, **kwargs) -> None:
        self.aggregation = build("mean")
        super().__init__(*args, **kwargs)


def _python_children() -> list[psutil.Process]:
    return [c for c in psutil.Process().children(recursive=True) if c.name() != "p2pd"]


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("in_thread", [True, False], ids=["threads", "processes"])
def test_two_peers_average_with_their_dht_and_averagers_served_where_asked(in_thread, caplog):
    from cotrain.net.dht import create_dht

    before = {c.pid for c in _python_children()}
    local = ["/ip4/127.0.0.1/tcp/0"]
    first = create_dht(host_maddrs=local, in_thread=in_thread)
    second = create_dht(
        host_maddrs=local, initial_peers=[str(a) for a in first.get_visible_maddrs()], in_thread=in_thread
    )
    gen = torch.Generator().manual_seed(3)
    tensors = [[torch.randn(5000, generator=gen), torch.randn(7, 9, generator=gen)] for _ in range(2)]
    settings = dict(prefix="hosting-test", target_group_size=2, min_matchmaking_time=3.0, request_timeout=1.5)
    # two averagers per peer, as a trainer has (gradients and state); only the first pair averages
    made = [
        Averager([t.clone() for t in own], dht, start=True, **settings)
        for own, dht in zip(tensors, (first, second), strict=True)
    ]
    idle = [Averager([torch.zeros(3)], dht, start=True, prefix="hosting-idle") for dht in (first, second)]
    everything = [*made, *idle]
    try:
        spawned = [c for c in _python_children() if c.pid not in before]
        # processes: a DHT and 2 averagers per peer; threads: none beside this process (and its p2pd daemons)
        assert len(spawned) == (0 if in_thread else 6), [c.cmdline() for c in spawned]
        assert all(a.is_alive() for a in everything)
        for _ in range(3):  # matchmaking on a loaded machine may miss; the round is run again
            controls = [a.step(wait=False, timeout=30) for a in made]
            deadline = time.monotonic() + 45
            while not all(c.done() for c in controls) and time.monotonic() < deadline:
                time.sleep(0.1)
            if all(c.done() and not c.exception() and len(c.result()) == 2 for c in controls):
                break
        else:
            pytest.fail("the two peers never averaged together")
        mean = [(a + b) / 2 for a, b in zip(*tensors, strict=True)]
        for averager in made:
            with averager.get_tensors() as got:
                for g, e in zip(got, mean, strict=True):
                    torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    finally:
        with caplog.at_level(logging.WARNING):
            for a in everything:
                a.shutdown()
            second.shutdown()
            first.shutdown()
    assert not any(a.is_alive() for a in everything) and not first.is_alive() and not second.is_alive()
    assert not [c for c in _python_children() if c.pid not in before]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records
    ]
