"""Helpers the test_data_prepare tests share across suites."""

from __future__ import annotations

import itertools
import unicodedata
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import WIKITEXT
from cotrain.data import (
    read_wikitext,
)


def normalized(text: str) -> str:
    return "".join(unicodedata.normalize("NFKC", text).lower().split())


def rows(root: Path, manifest: dict, split: str = "train") -> list[dict]:
    return [r for e in manifest["shards"][split] for r in pq.read_table(root / e["path"]).to_pylist()]


@pytest.fixture(scope="module")
def wiki_docs() -> list[str]:
    return list(itertools.islice(read_wikitext(WIKITEXT), 400))
