"""A peer's DHT and averagers served from threads of its process (cotrain.hivemind_ext.hosting), or from
processes of their own (``--swarm-processes``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler

import psutil
import pytest
import torch
import uvloop
from hivemind.averaging import DecentralizedAverager
from hivemind.utils.mpfuture import MPFuture

from cotrain.algorithms.aggregation import build
from cotrain.hivemind_ext import hosting
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.reducers import RobustAveraging


@pytest.mark.parametrize("setstate", ["cotrain", "hivemind"])
def test_a_future_unpickled_in_the_process_that_made_it_sends_its_result_to_the_original(
    setstate, monkeypatch
):
    hosting.same_process_futures()
    if setstate == "hivemind":  # the control: hivemind's own unpickling
        monkeypatch.setattr(MPFuture, "__setstate__", hosting._hivemind_setstate)
    original = MPFuture()
    copy = ForkingPickler.loads(ForkingPickler.dumps(original))  # as a request through a pipe to a thread
    assert copy is not original
    setter = threading.Thread(target=copy.set_result, args=(42,))
    setter.start()
    setter.join(10)
    if setstate == "cotrain":
        assert original.result(timeout=10) == 42
    else:  # the copy took itself for the original: it marked the shared state finished and kept the result
        assert original.result(timeout=1) is None


@pytest.mark.parametrize("set_event", ["cotrain", "hivemind"])
def test_a_future_of_an_idle_loop_is_finished_from_a_thread_that_runs_its_own(set_event, monkeypatch):
    hosting.same_process_futures()
    if set_event == "hivemind":
        monkeypatch.setattr(MPFuture, "_set_event_threadsafe", hosting._hivemind_set_event)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the training thread's loop: it exists, it does not run
    try:
        future = MPFuture()
        errors: list[BaseException] = []

        def serve() -> None:  # an averager's or the DHT's thread answering a request
            async def answer() -> None:
                future.set_result("ready")

            try:
                asyncio.run(answer())
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=serve)
        thread.start()
        thread.join(10)
        if set_event == "cotrain":
            assert not errors and future.result(timeout=1) == "ready"
            assert loop.run_until_complete(asyncio.wait_for(future, 5)) == "ready"  # awaitable on its loop
        else:
            assert errors and "another loop is running" in str(errors[0])
    finally:
        asyncio.set_event_loop(None)
        loop.close()


@pytest.mark.parametrize("loop_kind", ["cotrain", "hivemind"])
def test_a_serving_loop_keeps_a_task_that_nothing_else_refers_to_until_it_is_done(loop_kind, caplog):
    """A task awaiting an event that only its own coroutine refers to (as a step's matchmaking awaits an
    MPFuture answered by id through the update pipe) survives a garbage collection in another thread."""
    loop = hosting._ServingLoop() if loop_kind == "cotrain" else uvloop.new_event_loop()  # hivemind's
    events: list[weakref.ref] = []
    done: list[str] = []

    async def orphan() -> None:
        event = asyncio.Event()
        events.append(weakref.ref(event))
        await event.wait()
        done.append("answered")

    server = threading.Thread(target=loop.run_forever, daemon=True)
    server.start()
    try:
        loop.call_soon_threadsafe(lambda: loop.create_task(orphan()) and None)  # no reference kept
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            gc.collect()  # from this thread, as the training thread's collector runs
        event = events[0]()
        if loop_kind == "cotrain":
            assert event is not None and not caplog.records
            loop.call_soon_threadsafe(event.set)
            deadline = time.monotonic() + 10
            while not done and time.monotonic() < deadline:
                time.sleep(0.01)
            assert done == ["answered"]
        else:  # collected while pending, its coroutine closed (asyncio's report of it may come from either
            # thread's collector, and other tests' log set-up decides whether it reaches caplog)
            assert event is None
    finally:
        loop.call_soon_threadsafe(loop.stop)
        server.join(10)
        loop.close()


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


STOPPING_AT_EXIT = """
import sys, threading, time, torch
from cotrain.hivemind_ext import hosting
hosting.EXIT_GRACE_S = float(sys.argv[2])
a = torch.randn(1500, 1500)
stop, started = threading.Event(), threading.Event()
def work():  # long pieces of tensor work, a stop looked at between them (an all-reduce's part, a fingerprint)
    started.set()
    while not stop.is_set():
        for _ in range(20):
            a.add_(1.0).mul_(0.999)
def stuck():  # never looks
    while True:
        time.sleep(0.05)
thread = threading.Thread(target=stuck if sys.argv[1] == "stuck" else work, daemon=True)
thread.start()
started.wait(1.0)
time.sleep(0.3)
if sys.argv[1] == "finalized":  # a peer left running: its finalizer stops the thread at exit
    import weakref
    class Peer:
        pass
    peer = Peer()
    weakref.finalize(peer, lambda: (stop.set(), hosting.join_at_exit(thread)))
else:
    stop.set()
    if sys.argv[1] != "left":
        hosting.join_at_exit(thread)
print("exiting", time.time(), flush=True)
sys.exit(0)
"""


def _exit_of(kind: str, grace: float = 15.0) -> tuple[int, str, float]:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STOPPING_AT_EXIT, kind, str(grace)], capture_output=True, text=True, timeout=60
    )
    ended = time.time()
    exiting = [line.split() for line in done.stdout.splitlines() if line.startswith("exiting")]
    assert exiting, done.stderr[-2000:]
    # from the moment the script began to exit (its imports, slow on a loaded machine, do not count)
    return done.returncode, done.stderr, ended - float(exiting[0][1])


@pytest.mark.slow
def test_a_thread_asked_to_stop_finishes_its_tensor_work_before_the_process_exits():
    # left to Python, a daemon thread inside a torch operation at exit aborts the whole process
    aborts = []
    for _ in range(3):
        rc, err, _ = _exit_of("left")
        aborts.append(rc != 0 and "terminate called without an active exception" in err)
        if aborts[-1]:
            break
    assert any(aborts), "a daemon thread in tensor work at exit no longer aborts the process"
    # given to join_at_exit, it ends its piece of work and the process exits cleanly: when its peer was shut
    # down before the exit, and when the peer's own finalizer shuts it down at the exit
    for kind in ("joined", "finalized"):
        rc, err, _ = _exit_of(kind)
        assert rc == 0, (kind, err[-2000:])
    # and a thread that never ends holds the exit up for the grace period only
    rc, err, took = _exit_of("stuck", grace=1.0)
    assert rc == 0, err[-2000:]
    assert took < 10, took
