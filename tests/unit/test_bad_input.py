"""Bad input, table-driven.

Here, in the test process alone; the rest in tests/live/test_bad_input.py."""

from __future__ import annotations

from support.bad_input import CASES


def test_the_table_is_large_enough():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)
