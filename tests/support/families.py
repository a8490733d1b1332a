"""Helpers the test_families tests share across suites."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import WIKITEXT

# the CPU-sized twin of each full-size preset
TWINS = {
    "albert-large-v2": "albert-tiny",
    "albert-base-v2": "albert-tiny",
    "bert-base": "bert-tiny",
    "distilbert-base": "distilbert-tiny",
    "roberta-base": "roberta-tiny",
    "gpt2-small": "gpt2-tiny",
    "llama-150m": "llama-tiny",
    "qwen-500m": "qwen-tiny",
    "llama-1b": "llama-1b-tiny",
}


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """The first ~300 KB of WikiText-2's validation file (real text in the wikitext-103 format)."""
    path = tmp_path_factory.mktemp("corpus") / "wiki.txt"
    text = WIKITEXT.read_text()
    end = text.find("\n = ", 300_000)  # the first article boundary after 300 KB (none in the short sample)
    path.write_text(text if end < 0 else text[: end + 1])
    return path
