"""notebooks/join.ipynb, executed headless with nbclient in this virtual environment's kernel against a live
swarm on 127.0.0.1 (a monitor and one trainer on the CPU).

Here, in the test process alone; the rest in tests/live/test_notebook.py."""

from __future__ import annotations

import re

from support.notebook import NOTEBOOK, nbformat


def test_the_first_cell_holds_the_parameters():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "code" and "parameters" in first.metadata.get("tags", [])
    names = re.findall(r"^([A-Z_]+) = ", first.source, flags=re.M)
    for name in (
        "INITIAL_PEERS",
        "RUN_ID",
        "DATASET",
        "ACCESS_TOKEN",
        "INSTALL",
        "MAX_STEPS",
        "TIME_LIMIT_MINUTES",
    ):
        assert name in names, name
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "saved with outputs"
