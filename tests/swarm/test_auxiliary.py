"""The monitor as an auxiliary reducer.

Here, with hivemind in the test process; the rest in tests/live/test_auxiliary.py and
tests/unit/hivemind_ext/test_auxiliary.py."""

from __future__ import annotations

import pytest

from conftest import (
    DEAD_PEER,
    LOCALHOST,
)
from cotrain.net import reachability


@pytest.mark.timeout(60)
def test_a_probe_nobody_answers_returns_at_once_and_assumes_nothing():
    found = reachability.dial_back([DEAD_PEER], [LOCALHOST], [], timeout=5.0)
    assert found.reached is None and found.peer == "" and found.addresses
