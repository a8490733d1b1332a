"""Bad input, table-driven: every row ends in one clear line, a non-zero exit, no traceback and no file left.

Most rows call the CLI's entry function (`cotrain.cli.main`) in this process; the rows that need the network
layer or a training process start `cotrain` as a user would. ``python tests/live/test_bad_input.py`` runs
every row and prints the table recorded in docs/reliability.md.
"""

from __future__ import annotations

from support.bad_input import CASES


def test_the_table_is_large_enough():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)
