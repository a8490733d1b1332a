"""ALBERT sentence-order-prediction (SOP) examples, following the original recipe.

Per document: split into sentences, pack consecutive sentences into chunks that fit
``max_length - 3`` tokens, split each chunk at a random sentence boundary into segments A and B,
swap them with probability 1/2 (``sentence_order_label`` 1 = swapped) and encode the pair as
``[CLS] A [SEP] B [SEP]``. Masking for MLM happens later, per batch, in the collator.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from cotrain.data.corpus import split_sentences
from cotrain.data.errors import DataError

EXAMPLE_COLUMNS = (
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "special_tokens_mask",
    "sentence_order_label",
)
MIN_MAX_LENGTH = 8


def document_rng(document: str, seed: int) -> random.Random:
    """A random generator that depends only on the seed and the document's text, so the examples
    of a document do not depend on which documents came before it."""
    digest = hashlib.sha256(document.encode("utf-8")).hexdigest()
    return random.Random(f"{seed}:{digest}")


def units(sentence_ids: list[list[int]], budget: int) -> list[list[int]]:
    """Sentences as token lists; a sentence longer than ``budget`` is cut into consecutive pieces
    of at most ``budget // 2`` tokens, so that its pieces can still form an ordered pair."""
    units: list[list[int]] = []
    piece = max(1, budget // 2)
    for ids in sentence_ids:
        if len(ids) > budget:
            units.extend(ids[i : i + piece] for i in range(0, len(ids), piece))
        elif ids:
            units.append(ids)
    return units


def pack_chunks(units: list[list[int]], budget: int) -> list[list[list[int]]]:
    """Greedily group consecutive units into chunks of at most ``budget`` tokens in total."""
    chunks: list[list[list[int]]] = []
    chunk: list[list[int]] = []
    length = 0
    for unit in units:
        if chunk and length + len(unit) > budget:
            chunks.append(chunk)
            chunk, length = [], 0
        chunk.append(unit)
        length += len(unit)
    if chunk:
        chunks.append(chunk)
    return chunks


def encode_pair(a: list[int], b: list[int], tokenizer: PreTrainedTokenizerBase, label: int) -> dict[str, Any]:
    """``[CLS] a [SEP] b [SEP]`` with the columns the tokenizer's pair template produces (token
    type 1 on ``b [SEP]``; the special-tokens mask marks [CLS] and [SEP] only)."""
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    n_a, n_b = len(a) + 2, len(b) + 1
    return {
        "input_ids": [cls_id, *a, sep_id, *b, sep_id],
        "token_type_ids": [0] * n_a + [1] * n_b,
        "attention_mask": [1] * (n_a + n_b),
        "special_tokens_mask": [1] + [0] * len(a) + [1] + [0] * len(b) + [1],
        "sentence_order_label": label,
    }


def document_examples(
    document: str, tokenizer: PreTrainedTokenizerBase, max_length: int, seed: int
) -> list[dict[str, Any]]:
    """The SOP examples of one document (none if it has fewer than two sentences)."""
    sentences = split_sentences(document)
    if len(sentences) < 2:
        return []
    sentence_ids = tokenizer(sentences, add_special_tokens=False)["input_ids"]
    return examples_from_ids(document, sentence_ids, tokenizer, max_length, seed)


def examples_from_ids(
    document: str,
    sentence_ids: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    seed: int,
) -> list[dict[str, Any]]:
    """The SOP examples of a document whose sentences are already tokenized (``sentence_ids``)."""
    if len(sentence_ids) < 2:
        return []
    budget = max_length - 3
    rng = document_rng(document, seed)
    examples = []
    for chunk in pack_chunks(units(sentence_ids, budget), budget):
        if len(chunk) < 2:
            continue
        a_end = rng.randint(1, len(chunk) - 1)
        a = [token for unit in chunk[:a_end] for token in unit]
        b = [token for unit in chunk[a_end:] for token in unit]
        swapped = rng.random() < 0.5
        if swapped:
            a, b = b, a
        examples.append(encode_pair(a, b, tokenizer, int(swapped)))
    return examples


def build_sop_examples(
    documents: Iterable[str], tokenizer: PreTrainedTokenizerBase, max_length: int, seed: int
) -> Iterator[dict[str, Any]]:
    """Yield SOP examples (columns: ``EXAMPLE_COLUMNS``) for each document in turn. Every example
    has at most ``max_length`` tokens; the result is a function of the documents and the seed."""
    if max_length < MIN_MAX_LENGTH:
        raise DataError(f"max_length must be at least {MIN_MAX_LENGTH}, got {max_length}")
    if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise DataError("the tokenizer has no [CLS]/[SEP] token; SOP examples need both")
    for document in documents:
        yield from document_examples(document, tokenizer, max_length, seed)
