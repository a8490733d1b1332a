"""hivemind's log lines as a peer shows them: its expected network failures as one line each."""

from __future__ import annotations

import logging


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces."""
    return " ".join(str(text).split())


class OneLineErrors(logging.Filter):
    """hivemind logs expected network failures (a peer left, no group found) and some of its own races
    (through asyncio's logger) with full tracebacks, and passes on libp2p's errors, whose text spans lines;
    show each as one line unless --verbose."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("hivemind", "asyncio")):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if exc is not None or "\n" in message:
            record.msg = one_line(f"{message} ({type(exc).__name__}: {exc})" if exc else message)
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def one_line_errors() -> None:
    """Put OneLineErrors on every handler that hivemind's records reach (its own handler, or the root
    logger's when they propagate there), once. Call it before the peer's averager processes start: they
    inherit the handlers."""
    from hivemind.utils.logging import get_logger

    package = get_logger("hivemind")
    handlers = list(package.handlers)
    if package.propagate:
        handlers += logging.getLogger().handlers
    for handler in handlers:
        if not any(isinstance(f, OneLineErrors) for f in handler.filters):
            handler.addFilter(OneLineErrors())


ABANDONED = ("Task was destroyed but it is pending", "Task exception was never retrieved", "GeneratorExit")


class QuietWhileStopping(logging.Filter):
    """Once the peer is stopping (``stopping`` set), drop asyncio's and hivemind's reports of averaging tasks
    that the stop abandoned: a round under way when the peer stops leaves tasks that nothing refers to, which
    the next garbage collection (in any of the worker's threads) destroys pending, each with an error line. An
    averager in a process of its own exited before its collector ran."""

    def __init__(self, stopping) -> None:
        super().__init__()
        self.stopping = stopping

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping.is_set() or not record.name.startswith(("hivemind", "asyncio")):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{record.getMessage()} {type(exc).__name__ if exc is not None else ''}"
        return not any(marker in text for marker in ABANDONED)


def quiet_while_stopping(stopping) -> None:
    """Put QuietWhileStopping on the handlers that hivemind's and asyncio's records reach, once."""
    handlers = list(logging.getLogger().handlers)
    from hivemind.utils.logging import get_logger

    handlers += get_logger("hivemind").handlers
    for handler in handlers:
        if not any(isinstance(f, QuietWhileStopping) for f in handler.filters):
            handler.addFilter(QuietWhileStopping(stopping))
