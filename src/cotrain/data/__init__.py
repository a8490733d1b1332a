"""The data layer: corpora, tokenizers, examples per objective, sharded prepared datasets, streaming
them to trainers, and batching.

Names are imported on first use, so that ``cotrain prepare`` does not pay for torch (the collators)
or ``datasets`` (recipe data) when it does not need them."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "EXAMPLE_COLUMNS": "albert",
    "build_sop_examples": "albert",
    "AlbertCollator": "collator",
    "ClmCollator": "collator",
    "MlmCollator": "collator",
    "collator_for": "collator",
    "demo_corpus": "corpus",
    "read_text_files": "corpus",
    "read_wikitext": "corpus",
    "split_sentences": "corpus",
    "PreparedData": "dataset",
    "document_split": "dataset",
    "load_prepared": "dataset",
    "prepare_dataset": "dataset",
    "read_manifest": "manifest",
    "DataError": "errors",
    "OBJECTIVES": "objectives",
    "import_recipe": "sources",
    "prepare_from_source": "sources",
    "ExampleStream": "stream",
    "manifest_sha256": "stream",
    "TOKENIZER_TYPES": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenizer_hash": "tokenizer",
    "train_albert_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
