"""Training examples per objective, built from a batch of documents at a time.

- ``sop+mlm`` (ALBERT): sentence-order pairs (``cotrain.data.albert``); masking happens at train time.
- ``mlm`` (BERT, RoBERTa, DistilBERT): consecutive sentences of a document packed into sequences of up
  to ``max_length`` tokens, ``[CLS] ... [SEP]``; masking (optionally of whole words) at train time.
- ``clm`` (GPT-2): the token stream of all documents, each ended by the end-of-text token, cut into
  contiguous blocks of exactly ``max_length`` tokens (the last partial block of a split is dropped).

A batch of documents is tokenized with one call of the fast tokenizer's backend (``encode_batch``),
which is much cheaper than one ``tokenizer(...)`` call per document.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerFast

from cotrain.data.albert import EXAMPLE_COLUMNS, examples_from_ids, pack_chunks, units
from cotrain.data.corpus import split_sentences
from cotrain.data.errors import DataError

OBJECTIVES = ("sop+mlm", "mlm", "clm")
SPLITS = ("train", "validation")


def schema(objective: str) -> pa.Schema:
    """The columns of a prepared shard of ``objective``."""
    ids = pa.field("input_ids", pa.list_(pa.int32()))
    small = pa.list_(pa.int8())
    if objective == "sop+mlm":
        return pa.schema(
            [
                ids,
                pa.field("token_type_ids", small),
                pa.field("attention_mask", small),
                pa.field("special_tokens_mask", small),
                pa.field("sentence_order_label", pa.int8()),
            ]
        )
    if objective == "mlm":
        return pa.schema([ids, pa.field("attention_mask", small), pa.field("special_tokens_mask", small)])
    if objective == "clm":
        return pa.schema([ids])
    raise DataError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")


def columns(objective: str) -> list[str]:
    return list(EXAMPLE_COLUMNS) if objective == "sop+mlm" else schema(objective).names


@dataclass(frozen=True)
class BuildSpec:
    """Everything a worker needs to turn documents into examples (picklable)."""

    objective: str
    max_length: int
    seed: int
    valid_fraction: float
    tokenizer_dir: str


def _mlm_examples(
    sentence_ids: list[list[int]], cls_id: int, sep_id: int, max_length: int
) -> list[list[int]]:
    budget = max_length - 2
    return [
        [cls_id, *(t for unit in chunk for t in unit), sep_id]
        for chunk in pack_chunks(units(sentence_ids, budget), budget)
    ]


def _rows_to_batch(rows: list[dict[str, Any]], objective: str) -> pa.RecordBatch:
    sch = schema(objective)
    return pa.RecordBatch.from_arrays(
        [pa.array([row[name] for row in rows], type=sch.field(name).type) for name in sch.names], schema=sch
    )


def encode_documents(
    documents: list[str], sides: list[str], tokenizer: PreTrainedTokenizerFast, spec: BuildSpec
) -> dict[str, Any]:
    """Examples of a batch of documents, per split: a ``pa.RecordBatch`` for ``sop+mlm`` and ``mlm``,
    for ``clm`` a flat int32 array of the documents' tokens (each ended by the end-of-text token), which
    the caller cuts into blocks in corpus order. ``sides[i]`` is the split of ``documents[i]``."""
    backend = tokenizer.backend_tokenizer
    # encode_batch_fast (tokenizers >= 0.21) skips computing offsets, which are not needed here
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    if spec.objective == "clm":
        encodings = encode(documents, add_special_tokens=False)
        eos = tokenizer.eos_token_id
        out: dict[str, Any] = {}
        for split in SPLITS:
            parts = [
                np.append(np.asarray(e.ids, dtype=np.int32), eos)
                for e, s in zip(encodings, sides, strict=True)
                if s == split
            ]
            out[split] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return out
    sentences = [split_sentences(document) for document in documents]
    flat = [sentence for doc_sentences in sentences for sentence in doc_sentences]
    ids = [e.ids for e in encode(flat, add_special_tokens=False)] if flat else []
    # plain attributes instead of the tokenizer's slow properties, read once per example
    special = SimpleNamespace(cls_token_id=tokenizer.cls_token_id, sep_token_id=tokenizer.sep_token_id)
    rows: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    start = 0
    for document, doc_sentences, side in zip(documents, sentences, sides, strict=True):
        sentence_ids = ids[start : start + len(doc_sentences)]
        start += len(doc_sentences)
        if spec.objective == "sop+mlm":
            rows[side].extend(examples_from_ids(document, sentence_ids, special, spec.max_length, spec.seed))
        else:
            for seq in _mlm_examples(
                sentence_ids, special.cls_token_id, special.sep_token_id, spec.max_length
            ):
                n = len(seq)
                rows[side].append(
                    {
                        "input_ids": seq,
                        "attention_mask": [1] * n,
                        "special_tokens_mask": [1] + [0] * (n - 2) + [1],
                    }
                )
    return {split: _rows_to_batch(rows[split], spec.objective) for split in SPLITS}


class BlockPacker:
    """Cuts a stream of token arrays into contiguous ``length``-token blocks (causal LM)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.buffer = np.zeros(0, dtype=np.int32)

    def add(self, tokens: np.ndarray) -> pa.RecordBatch | None:
        self.buffer = np.concatenate([self.buffer, tokens]) if len(self.buffer) else tokens
        n = len(self.buffer) // self.length
        if n == 0:
            return None
        values, self.buffer = self.buffer[: n * self.length], self.buffer[n * self.length :].copy()
        offsets = pa.array(np.arange(0, n * self.length + 1, self.length, dtype=np.int32))
        blocks = pa.ListArray.from_arrays(offsets, pa.array(values, type=pa.int32()))
        return pa.RecordBatch.from_arrays([blocks], schema=schema("clm"))
