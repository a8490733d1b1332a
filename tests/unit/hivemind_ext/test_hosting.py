"""A peer's DHT and averagers served from threads of its process (cotrain.hivemind_ext.hosting), or from
processes of their own (``--swarm-processes``).

Here, in the test process alone; the rest in tests/live/test_hosting.py and tests/swarm/test_hosting.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler

import pytest
import uvloop
from hivemind.utils.mpfuture import MPFuture

from cotrain.hivemind_ext import hosting


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
