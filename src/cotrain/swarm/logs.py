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
