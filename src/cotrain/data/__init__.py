"""The data layer: corpora, tokenizers, examples per objective, sharded prepared datasets, streaming
them to trainers, and batching."""

from cotrain.data.albert import EXAMPLE_COLUMNS, build_sop_examples
from cotrain.data.collator import AlbertCollator, ClmCollator, MlmCollator, collator_for
from cotrain.data.corpus import demo_corpus, read_text_files, read_wikitext, split_sentences
from cotrain.data.dataset import (
    PreparedData,
    document_split,
    load_prepared,
    prepare_dataset,
    read_manifest,
)
from cotrain.data.errors import DataError
from cotrain.data.objectives import OBJECTIVES
from cotrain.data.sources import import_recipe, prepare_from_source
from cotrain.data.stream import ExampleStream
from cotrain.data.tokenizer import (
    TOKENIZER_TYPES,
    load_tokenizer,
    tokenizer_hash,
    train_albert_tokenizer,
    train_tokenizer,
)

__all__ = [
    "EXAMPLE_COLUMNS",
    "OBJECTIVES",
    "TOKENIZER_TYPES",
    "AlbertCollator",
    "ClmCollator",
    "DataError",
    "ExampleStream",
    "MlmCollator",
    "PreparedData",
    "build_sop_examples",
    "collator_for",
    "demo_corpus",
    "document_split",
    "import_recipe",
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
    "train_tokenizer",
]
