"""cotrain's gradient averager.

Here, in the test process alone; the rest in tests/swarm/test_averaging.py."""

import pytest

from cotrain.hivemind_ext.averaging import gradient_averager_factory

pytestmark = [pytest.mark.timeout(120)]


def test_read_ahead_below_one_is_refused():
    with pytest.raises(ValueError, match="read_ahead must be at least 1"):
        gradient_averager_factory({"read_ahead": 0})
