"""The data layer: corpora, the ALBERT tokenizer, SOP examples, prepared datasets and batching."""

from cotrain.data.albert import EXAMPLE_COLUMNS, build_sop_examples
from cotrain.data.collator import AlbertCollator
from cotrain.data.corpus import demo_corpus, read_text_files, read_wikitext, split_sentences
from cotrain.data.dataset import (
    PreparedData,
    document_split,
    load_prepared,
    prepare_dataset,
    prepare_from_source,
    read_manifest,
)
from cotrain.data.errors import DataError
from cotrain.data.tokenizer import load_tokenizer, tokenizer_hash, train_albert_tokenizer

__all__ = [
    "EXAMPLE_COLUMNS",
    "AlbertCollator",
    "DataError",
    "PreparedData",
    "build_sop_examples",
    "demo_corpus",
    "document_split",
    "load_prepared",
    "load_tokenizer",
    "prepare_dataset",
    "prepare_from_source",
    "read_manifest",
    "read_text_files",
    "read_wikitext",
    "split_sentences",
    "tokenizer_hash",
    "train_albert_tokenizer",
]
