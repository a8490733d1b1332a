"""Ending a peer in order (strategy, then DHT) and quietly: what hivemind leaves behind at interpreter exit
was ended on purpose."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from cotrain.hivemind_ext.hosting import join_at_exit

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def kept_interrupt() -> Iterator[None]:
    """Ctrl+C during the block is not lost: hivemind waits for an averaging round under ``except
    BaseException`` and goes on with the local gradients, so the KeyboardInterrupt raised in the wait never
    reached the script, which trained on. Here, in the main thread under Python's own SIGINT handler, a
    SIGINT during the block still raises where it lands, and the block's end raises it again if it was
    swallowed. Elsewhere (a role's own stop handler, another thread) it changes nothing."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    interrupted = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        interrupted.set()
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted.is_set():
        raise KeyboardInterrupt


class _DroppedTasks(logging.Filter):
    """After a peer's shutdown, asyncio reports the network tasks still pending in this process when the
    interpreter exits; they were ended on purpose, so these lines are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Task was destroyed but it is pending")


def _quiet_exit_hook(previous: Callable) -> Callable:
    """sys.unraisablehook minus hivemind's futures that, collected at exit after their event loop closed,
    complain that it is closed; anything else goes to the previous hook."""

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if (
            isinstance(exc, RuntimeError)
            and "Event loop is closed" in str(exc)
            and "MPFuture" in repr(unraisable.object)
        ):
            return
        previous(unraisable)

    hook.cotrain_quiet = True
    return hook


def shutdown_in_order(strategy: Any, connection: Any, cores: Any = None) -> None:
    """Stop a peer: its strategy (pending rounds cancelled, averagers ended), then its DHT; the network tasks
    that this leaves pending at interpreter exit are not reported."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DroppedTasks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DroppedTasks())
    if not getattr(sys.unraisablehook, "cotrain_quiet", False):
        sys.unraisablehook = _quiet_exit_hook(sys.unraisablehook)
    if strategy is not None:
        strategy.shutdown()
    if connection is not None:
        connection.close()
    if cores is not None:
        cores.close()


def leave_in_order(owner: object, stop: threading.Event, strategy: Any, connection: Any, cores: Any = None):
    """Arrange a peer's end: a thread that, once ``stop`` is set, cancels pending rounds until the peer has
    left; and the returned finalizer, which shuts the peer down in order (``shutdown_in_order``) when called,
    when ``owner`` is collected, or at the very start of the interpreter's exit."""
    left = threading.Event()
    canceller = threading.Thread(
        target=_cancel_rounds_when_set, args=(stop, left, strategy), daemon=True, name="stop-rounds"
    )
    canceller.start()
    finalizer = weakref.finalize(owner, _leave, strategy, connection, cores, left, canceller)
    _leave_before_threads_are_joined(finalizer)
    return finalizer


def _cancel_rounds_when_set(stop: threading.Event, left: threading.Event, strategy: Any) -> None:
    """When asked to stop, cancel pending averaging rounds so a blocked step returns within a second
    (hivemind then falls back to local gradients) and shutdown proceeds in order; until the peer has left.
    A round's future keeps its state in a torch tensor: a thread still cancelling at interpreter exit would
    be ended inside a torch call, which aborts the process (cotrain.hivemind_ext.hosting)."""
    while not left.wait(0.2):
        if stop.is_set():
            strategy.cancel_rounds()


def _leave_before_threads_are_joined(finalizer: weakref.finalize) -> None:
    """Have a peer still running at interpreter exit leave at the start of the exit, with its threads.

    Python joins the worker threads of every ``concurrent.futures`` thread pool at exit before it runs any
    ``atexit`` hook or finalizer; hivemind's serving threads (cotrain.hivemind_ext.hosting) keep work
    waiting in such a pool until the peer shuts down, so a script that ended without ``shutdown()`` waited
    forever.
    Hooks registered with ``threading._register_atexit`` (the pools' own mechanism) run first, newest
    first: the peer's shutdown comes before the pools are joined."""
    try:
        threading._register_atexit(finalizer)
    except (AttributeError, RuntimeError) as e:  # no such hook in this Python, or the exit already began
        logger.debug(f"A peer left running at exit will leave at its finalizer only: {e!r}")


def _leave(
    strategy: Any, connection: Any, cores: Any, left: threading.Event, canceller: threading.Thread
) -> None:
    """Shut the peer's parts down in order (``shutdown_in_order``), then end the thread that cancelled rounds
    meanwhile."""

    try:
        shutdown_in_order(strategy, connection, cores)
    finally:
        left.set()
        canceller.join(timeout=1.0)
        join_at_exit(canceller)
