"""Helpers the test_notebook tests share across suites."""

from __future__ import annotations

import pytest

from conftest import (
    REPO,
)

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (the dev extra)")


NOTEBOOK = REPO / "notebooks" / "join.ipynb"
