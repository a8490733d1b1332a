"""Where a peer's DHT and averagers run: threads of the peer's own process (cotrain's default), or a process
of their own each, forked from it (hivemind's way; ``--swarm-processes``).

hivemind makes its DHT and each averager a ``multiprocessing`` process that serves requests from a pipe. A
process forked from a worker that imported torch and transformers and built its model shares those pages
only until it writes them; each one's own heap, and the inherited pages it touches, are its alone. A trainer
of a 2M-parameter model was a tree of 6 processes and 934 MB PSS, 4 of them Python processes importing torch
(docs/benchmarks.md, memory). Served from threads, the same objects run in one process.

Four things in hivemind 1.1.12 assume a process of their own, and are mended here:
- every request to a DHT or an averager carries an ``MPFuture`` for its answer, pickled through the pipe.
  Unpickled in the process that made it, it became a second object that took itself for the original, and
  kept its result; it now sends it to the original, as a copy in another process does.
- a future's ``asyncio.Event`` belongs to the event loop of the thread that made the future. Finished from
  another thread whose own loop runs (a DHT's or an averager's) while that loop is idle, hivemind tried to run
  the idle loop from there (RuntimeError); the event is set directly then (``_set_event_threadsafe``).
- ``DHT.run`` ignores SIGINT with ``signal.signal``, which Python allows only in the main thread. In another
  thread that call is skipped (the worker keeps its own handlers). An averager's ``run_in_background`` ignores
  SIGINT in the calling thread for its forked process to inherit and leaves it so; the caller's handler is
  put back after (a script using ``SwarmPeer`` stops on Ctrl+C).
- a process ends with its event loop's tasks and objects as they are. A thread's loop is a ``_ServingLoop``,
  which, closing, finishes what is left while it can still run (``switch_to_uvloop`` makes it).

A process ends its daemon threads where they are: one inside a torch operation then aborts the whole process
("terminate called without an active exception", exit status 134: torch's C++ code cannot be unwound there).
A serving thread that did not stop within its shutdown's grace period, and cotrain's helper threads that
compute on tensors, are given up to ``EXIT_GRACE_S`` more at interpreter exit (``join_at_exit``).

A thread's loop also keeps each of its tasks until it is done. hivemind creates tasks and keeps no reference
to them (a step's matchmaking, the declaration of an averager in the DHT); such a task, awaiting an
``MPFuture`` answered by its id through the update pipe, is a cycle nothing else refers to. A process of its
own seldom collects its oldest objects; the training thread's process does often, and it destroyed such tasks
mid-round, closing their coroutines from the training thread. The averager's matchmaking was left broken: no
later round found a group (tests/live/test_partition.py, diloco).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
import traceback
import weakref

import torch
import uvloop
from hivemind.utils.asyncio import switch_to_uvloop as _hivemind_switch_to_uvloop
from hivemind.utils.mpfuture import MPFuture

logger = logging.getLogger(__name__)


DRAIN_SECONDS = 5.0  # at its end, how long a serving thread's remaining tasks get to finish once cancelled
_ELSEWHERE = -1  # the origin of an unpickled future, in the process that made it: never a process id
_hivemind_setstate = MPFuture.__setstate__


def _setstate(self: MPFuture, state: dict) -> None:
    """Unpickling in the process that made the future gives a copy that reports its result to the original
    through that process's update pipe, as a copy in any other process does."""
    _hivemind_setstate(self, state)
    if self._origin_pid == os.getpid():
        self._origin_pid = _ELSEWHERE


_hivemind_set_event = MPFuture._set_event_threadsafe


def _set_event_threadsafe(self: MPFuture) -> None:
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None or self._loop.is_running() or self._loop.is_closed():
        return _hivemind_set_event(self)
    # the future's loop is idle and this thread runs another one: nothing waits on the event right now
    self._aio_event.set()


class _ServingLoop(uvloop.Loop):
    """The event loop of a thread that serves a DHT or an averager. A process ends with its loop's tasks and
    objects as they are; a thread's would be destroyed later, in another thread, with the loop closed, each
    logging an error (hivemind's P2P client cancels its tasks in ``__del__``). Closing, it first cancels and
    awaits its remaining tasks, lets go of what a failed start left (the traceback of the error the start
    reported holds the P2P it made) and collects it while the loop can still run what that schedules."""

    def __init__(self) -> None:
        super().__init__()
        self._unfinished: set[asyncio.Future] = set()  # what keeps this loop's tasks until they are done
        self.set_task_factory(self._kept_task)

    def _kept_task(self, loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self._unfinished.add(task)
        task.add_done_callback(self._unfinished.discard)
        return task

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            self.run_until_complete(_cancel_and_wait(list(asyncio.all_tasks(self))))
            served = getattr(threading.current_thread(), "serves", None)
            ready = getattr(served, "_ready", None)
            if ready is not None and ready.done() and ready.exception() is not None:
                traceback.clear_frames(ready.exception().__traceback__)
            gc.collect()
            self.run_until_complete(asyncio.sleep(0))
            self.run_until_complete(self.shutdown_asyncgens())
        super().close()


def _switch_to_uvloop() -> asyncio.AbstractEventLoop:
    """hivemind's ``switch_to_uvloop`` (a new uvloop loop for this thread), a ``_ServingLoop`` in a serving
    thread."""
    if getattr(threading.current_thread(), "serves", None) is None:
        return _hivemind_switch_to_uvloop()
    uvloop.install()
    loop = threading.current_thread().serving_loop = _ServingLoop()
    asyncio.set_event_loop(loop)
    return loop


class _SignalsOutsideMainThread:
    """What ``hivemind.dht.dht`` sees as the ``signal`` module: setting a handler from a thread other than the
    main one does nothing (Python would raise ValueError)."""

    def __getattr__(self, name: str):
        return getattr(signal, name)

    @staticmethod
    def signal(signum: int, handler):
        if threading.current_thread() is threading.main_thread():
            return signal.signal(signum, handler)
        return signal.getsignal(signum)


def same_process_futures() -> None:
    """Install both mends (idempotent)."""
    import hivemind.averaging.averager as averager_module
    import hivemind.dht.dht as dht_module

    MPFuture.__setstate__ = _setstate
    MPFuture._set_event_threadsafe = _set_event_threadsafe
    dht_module.switch_to_uvloop = averager_module.switch_to_uvloop = _switch_to_uvloop
    if not isinstance(dht_module.signal, _SignalsOutsideMainThread):
        dht_module.signal = _SignalsOutsideMainThread()


class ServedInThread:
    """A mixin for hivemind's process classes (``DHT``, ``DecentralizedAverager``; put it first among the
    bases): a DHT whose ``in_thread`` is set, and an averager whose DHT's is, serves from a daemon thread of
    this process instead of a forked process; ``is_alive``, ``join`` and ``terminate`` then speak of that
    thread."""

    _serving_thread: threading.Thread | None = None

    def _serves_in_thread(self) -> bool:
        owner = getattr(self, "dht", self)  # an averager serves where its DHT does
        return bool(getattr(owner, "in_thread", False))

    def start(self) -> None:
        if not self._serves_in_thread():
            return super().start()
        same_process_futures()
        torch.get_num_threads()  # the calling (training) thread keeps its count of torch threads
        self._serving_thread = threading.Thread(
            target=self._serve_in_thread, name=f"{type(self).__name__}", daemon=True
        )
        self._serving_thread.start()

    def run_in_background(self, *args, **kwargs) -> None:
        """hivemind's averager ignores SIGINT in the calling thread around its start, for the process it forks
        to inherit, and leaves it ignored there: a script using ``SwarmPeer`` ran on through Ctrl+C. The
        caller's own handler is put back once the averager has started."""
        if threading.current_thread() is not threading.main_thread():
            return super().run_in_background(*args, **kwargs)
        handler = signal.getsignal(signal.SIGINT)
        try:
            return super().run_in_background(*args, **kwargs)
        finally:
            if handler is not None:
                signal.signal(signal.SIGINT, handler)

    def _serve_in_thread(self) -> None:
        # one torch thread for the tensor work of averaging here: a second OpenMP team as wide as the training
        # thread's would oversubscribe the cores (see cotrain.hivemind_ext.optimizer)
        torch.set_num_threads(1)
        threading.current_thread().serves = self  # its event loop will be a _ServingLoop
        # an averager's run() only starts _run_internal in a thread of its own (against broken OpenMP state
        # after a fork); here it is one already
        serve = getattr(self, "_run_internal", self.run)
        try:
            serve()
        finally:
            loop = getattr(threading.current_thread(), "serving_loop", None)
            if loop is not None and not loop.is_closed():  # hivemind closes the DHT's loop, not an averager's
                loop.close()

    def is_alive(self) -> bool:
        if self._serving_thread is None:
            return super().is_alive()
        return self._serving_thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._serving_thread is None:
            return super().join(timeout)
        self._serving_thread.join(timeout)

    def terminate(self) -> None:
        if self._serving_thread is None:
            return super().terminate()
        # a thread cannot be stopped from outside; as a daemon thread it ends with the process, which waits
        # for it a little (join_at_exit)
        logger.debug(f"{type(self).__name__} did not stop in time; it ends with the process")
        join_at_exit(self._serving_thread)

    kill = terminate

    def _shutdown(self, *args, **kwargs):
        """hivemind's shutdown request (a coroutine the serving loop awaits, then it ends), followed in a
        thread by cancelling the loop's other tasks and awaiting them at once (a step's matchmaking, left by
        the shutdown): the loop keeps them until they are done. A process ends with them as they are."""
        shutdown = super()._shutdown(*args, **kwargs)
        if self._serving_thread is None:
            return shutdown
        return _then_cancel_the_rest(shutdown, serving=asyncio.current_task())


async def _then_cancel_the_rest(shutdown, serving: asyncio.Task | None) -> None:
    await shutdown
    await _cancel_and_wait(
        [t for t in asyncio.all_tasks() if t is not serving and t is not asyncio.current_task()]
    )


async def _cancel_and_wait(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=DRAIN_SECONDS)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error was logged where it happened, if at all


EXIT_GRACE_S = 15.0  # at interpreter exit, for all the threads still stopping together
_stopping: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


class _AtExit:
    """What the exit finalizers share: the one that will run next, and the deadline once exiting began."""

    pending: weakref.finalize | None = None
    deadline: float | None = None


_at_exit = _AtExit()


def join_at_exit(thread: threading.Thread) -> None:
    """``thread`` (a daemon thread) was asked to stop: at interpreter exit, wait for it to end, up to
    EXIT_GRACE_S for all such threads together, rather than end it in the middle of its tensor work.

    The wait is a ``weakref.finalize`` callback, not a plain ``atexit`` one: finalizers run at exit newest
    first, one made while they run included, so this wait comes after any shutdown at exit that asked the
    thread to stop (a peer left running leaves earlier still: cotrain.engine.shutdown)."""
    if not thread.is_alive() or thread is threading.current_thread():
        return
    _stopping.add(thread)
    if _at_exit.pending is None or not _at_exit.pending.alive:
        _at_exit.pending = weakref.finalize(_at_exit, _join_stopping_threads)


def _join_stopping_threads() -> None:
    if _at_exit.deadline is None:
        _at_exit.deadline = time.monotonic() + EXIT_GRACE_S
    for thread in list(_stopping):
        thread.join(max(0.0, _at_exit.deadline - time.monotonic()))
