"""hivemind's expected network failures reach a peer's log as one line, in roles and in API peers."""

import io
import logging

from cotrain.swarm.logs import one_line_errors


def test_a_hivemind_failure_with_a_traceback_is_one_line_and_other_records_keep_theirs():
    from hivemind.utils.logging import get_logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    package = get_logger("hivemind")
    package.addHandler(handler)
    other = logging.getLogger("someone.else")
    other.addHandler(handler)
    try:
        one_line_errors()
        one_line_errors()  # idempotent: one filter per handler
        assert sum(type(f).__name__ == "OneLineErrors" for f in handler.filters) == 1
        try:
            raise TimeoutError("could not find a group")
        except TimeoutError:
            logging.getLogger("hivemind.averaging.averager").warning("Averaging step failed", exc_info=True)
            logging.getLogger("someone.else").error("their own failure", exc_info=True)
    finally:
        package.removeHandler(handler)
        other.removeHandler(handler)
    text = stream.getvalue()
    assert "Averaging step failed (TimeoutError: could not find a group)\n" in text
    # records of other loggers pass untouched, traceback and all
    assert text.count("Traceback") == 1 and text.index("their own failure") < text.index("Traceback")
