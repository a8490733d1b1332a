"""cotrain.engine.shutdown: a Ctrl+C that a round's wait swallowed still stops the script."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from cotrain.engine.shutdown import kept_interrupt


def swallowing_wait() -> str:
    """As hivemind waits for a round: anything raised in the wait means 'use the local gradients'."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the signal lands here
    except BaseException:
        return "local gradients"
    return "averaged"


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler, as in a script started from a terminal (a test worker may have SIGINT
    ignored, as a background job of a script has)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_swallowed_in_the_block_is_raised_at_its_end_and_the_handler_is_put_back(python_sigint):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with kept_interrupt():
            done.append(swallowing_wait())
    assert done == ["local gradients"]  # the block ran to its end as before, and then the script stopped
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with kept_interrupt():  # no Ctrl+C: nothing raised
        done.append("quiet")
    with pytest.raises(KeyboardInterrupt):  # one that is not swallowed is raised once, where it lands
        with kept_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_of_ones_own_and_other_threads_are_left_alone(python_sigint):
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with kept_interrupt():  # a role's own handler (a stop event): not wrapped, nothing raised
            assert swallowing_wait() == "averaged"
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    errors = []

    def in_a_thread() -> None:
        try:
            with kept_interrupt():
                pass
        except Exception as e:  # signal.signal outside the main thread would raise ValueError
            errors.append(e)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert errors == []
