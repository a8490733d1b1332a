"""hivemind's expected network failures reach a peer's log as one line, in roles and in API peers."""

import io
import logging
import sys

from cotrain.net.logs import OneLineErrors, one_line_errors


def record(name: str, msg: str) -> logging.LogRecord:
    try:
        raise TimeoutError("could not find a group")
    except TimeoutError:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, sys.exc_info())


def test_a_hivemind_failure_with_a_traceback_is_one_line_and_other_records_keep_theirs():
    from hivemind.utils.logging import get_logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    package = get_logger("hivemind")
    package.addHandler(handler)
    try:
        one_line_errors()
        one_line_errors()  # idempotent: one filter per handler
    finally:
        package.removeHandler(handler)
    assert sum(isinstance(f, OneLineErrors) for f in handler.filters) == 1
    handler.handle(record("hivemind.averaging.averager", "Averaging step failed"))
    handler.handle(record("someone.else", "their own failure"))
    text = stream.getvalue()
    assert "Averaging step failed (TimeoutError: could not find a group)\n" in text
    # records of other loggers pass untouched, traceback and all
    assert text.count("Traceback") == 1 and text.index("their own failure") < text.index("Traceback")


def test_a_hivemind_error_whose_text_spans_lines_is_one_line():
    """libp2p's connection errors reach hivemind's log with line breaks (its daemon's text): one line each."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(OneLineErrors())
    try:
        raise ConnectionError("failed to dial 12D3KooW...:\n  * [/ip4/127.0.0.1/tcp/1] dial refused")
    except ConnectionError:
        failed = logging.LogRecord(
            "hivemind.p2p", logging.WARNING, __file__, 1, "Failed to connect", None, sys.exc_info()
        )
    handler.handle(failed)
    plain = logging.LogRecord(
        "hivemind.dht", logging.WARNING, __file__, 1, "peer left:\n%s", ("details",), None
    )
    handler.handle(plain)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "Failed to connect (ConnectionError: failed to dial 12D3KooW...: * [/ip4/127.0.0.1/tcp/1] "
        "dial refused)",
        "peer left: details",
    ]


def test_abandoned_averaging_tasks_are_quiet_only_once_the_peer_is_stopping():
    import threading

    from cotrain.net.logs import QuietWhileStopping

    stopping = threading.Event()
    quiet = QuietWhileStopping(stopping)

    def record(name: str, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
        exc_info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, exc_info)

    destroyed = record("asyncio", "Task was destroyed but it is pending!")
    closed = record("hivemind.utils.asyncio", "Exception in <Task cancelling ...>:", GeneratorExit())
    other = record("hivemind.averaging.averager", "Averaging step failed: could not find a group")
    assert all(quiet.filter(r) for r in (destroyed, closed, other))  # while training: every error shows
    stopping.set()
    assert not quiet.filter(destroyed) and not quiet.filter(closed)
    assert quiet.filter(other) and quiet.filter(record("cotrain", "Task was destroyed but it is pending!"))
