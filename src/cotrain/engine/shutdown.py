"""Ending a peer in order (strategy, then DHT) and quietly: what hivemind leaves behind at interpreter exit
was ended on purpose."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any


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
