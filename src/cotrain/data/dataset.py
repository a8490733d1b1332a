"""Prepare a corpus into sharded training examples on disk, and load them back.

Layout of a prepared folder::

    out_dir/
      manifest.json          what was built and how (see prepare_dataset); written last
      tokenizer/             save_pretrained output
      train/00000.parquet    shards of at most shard_size examples each
      validation/00000.parquet

Everything is built in a temporary folder beside ``out_dir`` and renamed into place at the end, so
an interrupted run leaves no half-written ``out_dir`` (and an existing one is kept until the new one
is complete).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from transformers import PreTrainedTokenizerFast

from cotrain.data.albert import MIN_MAX_LENGTH
from cotrain.data.errors import DataError
from cotrain.data.fsutil import check_replaceable, inside, replace_dir, sha256_file, temp_dir_beside
from cotrain.data.manifest import FORMAT_VERSION, MANIFEST, TOKENIZER, read_manifest, why_not_prepared
from cotrain.data.objectives import OBJECTIVES, SPLITS, BuildSpec, columns, schema
from cotrain.data.pipeline import build_shards, read_spool, spool_documents
from cotrain.data.shards import ShardWriter, read_shard
from cotrain.data.split import document_split
from cotrain.data.tokenizer import (
    DEFAULT_TOKENIZER_TYPE,
    TOKENIZER_TYPES,
    load_tokenizer,
    save_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

OBJECTIVE = "sop+mlm"
DEFAULT_SHARD_SIZE = 10_000

__all__ = ["PreparedData", "document_split", "load_prepared", "prepare_dataset", "read_manifest"]


@dataclass
class PreparedData:
    """A prepared dataset: both splits formatted as torch tensors, its tokenizer and manifest."""

    train: datasets.Dataset
    validation: datasets.Dataset
    tokenizer: PreTrainedTokenizerFast
    manifest: dict[str, Any]


def _check_args(
    max_length: int, vocab_size: int, valid_fraction: float, objective: str, shard_size: int, num_proc: int
) -> None:
    problems = []
    if objective not in OBJECTIVES:
        problems.append(f"objective must be one of {', '.join(OBJECTIVES)} (got {objective!r})")
    if max_length < MIN_MAX_LENGTH:
        problems.append(f"max_length must be at least {MIN_MAX_LENGTH} (got {max_length})")
    if vocab_size < 100:
        problems.append(f"vocab_size must be at least 100 (got {vocab_size})")
    if not 0.0 <= valid_fraction < 1.0:
        problems.append(f"valid_fraction must be in [0, 1) (got {valid_fraction})")
    if shard_size < 1:
        problems.append(f"shard_size must be positive (got {shard_size})")
    if num_proc < 1:
        problems.append(f"num_proc must be at least 1 (got {num_proc})")
    if problems:
        raise DataError("; ".join(problems))


def check_dataset_replaceable(out_dir: Path) -> None:
    """UserError unless ``out_dir`` is absent, empty, or a dataset that ``prepare`` wrote (its manifest and
    nothing else but the tokenizer and the shards: a folder of someone else's that merely holds a file called
    manifest.json is never replaced)."""
    check_replaceable(out_dir, MANIFEST, "a cotrain dataset", why_not_prepared)


def write_atomically(out_dir: str | Path, build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Run ``build(tmp)`` in a temporary folder beside ``out_dir`` and rename it into place once it
    returned; on any error (or Ctrl+C) the temporary folder is removed and ``out_dir`` is untouched."""
    out_dir = Path(out_dir).absolute()
    check_dataset_replaceable(out_dir)  # before any work: a user's folder is refused
    tmp = temp_dir_beside(out_dir)
    try:
        manifest = build(tmp)
        replace_dir(tmp, out_dir, MANIFEST, "a cotrain dataset", why_not_prepared)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counts = manifest["num_examples"]
    logger.info(
        "prepared %d train / %d validation examples into %s", counts["train"], counts["validation"], out_dir
    )
    return manifest


def tokenizer_entry(
    tokenizer: PreTrainedTokenizerFast, folder: Path, kind: str, **extra: Any
) -> dict[str, Any]:
    """The manifest's description of the tokenizer saved in ``folder``: its content hash and a sha256
    per file (so a trainer can fetch and verify it over HTTP)."""
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()}
    return {"path": TOKENIZER, "type": kind, "hash": tokenizer_hash(tokenizer), "vocab_size": len(tokenizer),
            "files": files, **extra}  # fmt: skip


def finish_manifest(
    tmp: Path,
    writers: dict[str, ShardWriter],
    tokenizer: dict[str, Any],
    *,
    objective: str,
    max_length: int,
    seed: int,
    valid_fraction: float,
    num_documents: dict[str, int],
    source: dict[str, Any],
    config: dict[str, Any],
) -> dict[str, Any]:
    """Write ``manifest.json`` (the last file of a prepared folder) and return it."""
    num_examples = {split: writers[split].num_examples for split in SPLITS}
    total = sum(num_examples.values())
    if num_examples["train"] == 0:
        need = {
            "sop+mlm": "SOP needs documents with at least two sentences",
            "mlm": "the corpus has no text",
            "clm": f"causal LM needs at least {max_length} tokens of training text",
        }[objective]
        raise DataError(f"no training examples from {sum(num_documents.values())} documents: {need}")
    if num_examples["validation"] == 0:
        logger.warning("the validation split is empty; use a larger corpus or a larger valid_fraction")
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "objective": objective,
        "max_length": max_length,
        "seed": seed,
        "valid_fraction": valid_fraction,
        "source": source,
        "config": config,
        "columns": columns(objective),
        "num_documents": num_documents,
        "num_examples": num_examples,
        "num_tokens": {split: writers[split].num_tokens for split in SPLITS},
        "mean_tokens_per_example": sum(w.num_tokens for w in writers.values()) / total,
    }
    if objective == "sop+mlm":
        manifest["sop_swapped_fraction"] = sum(w.num_swapped for w in writers.values()) / total
    manifest |= {
        "tokenizer": tokenizer,
        "tokenizer_hash": tokenizer["hash"],
        "vocab_size": tokenizer["vocab_size"],
        "shards": {split: writers[split].shards for split in SPLITS},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def prepare_dataset(
    documents: Iterable[str],
    out_dir: str | Path,
    *,
    max_length: int,
    seed: int = 0,
    tokenizer_path: str | None = None,
    vocab_size: int = 8000,
    valid_fraction: float = 0.02,
    progress: bool = False,
    objective: str = OBJECTIVE,
    tokenizer_type: str = "",
    shard_size: int = DEFAULT_SHARD_SIZE,
    num_proc: int = 1,
    source: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Turn ``documents`` into ``objective`` examples and save them as shards, with the tokenizer and
    a manifest, to ``out_dir`` (atomically). Trains a tokenizer of ``tokenizer_type`` (default: the
    objective's, ``DEFAULT_TOKENIZER_TYPE``) and ``vocab_size`` on the documents unless
    ``tokenizer_path`` is given. Documents are assigned to "train" or "validation" by a hash of their
    text (about ``valid_fraction`` of them go to validation). ``num_proc`` worker processes make the
    examples; the result does not depend on it. Returns the manifest:

    ``format_version, objective, max_length, seed, valid_fraction, source, config, columns,
    num_documents{split}, num_examples{split}, num_tokens{split}, mean_tokens_per_example,
    sop_swapped_fraction (sop+mlm), tokenizer{path,type,hash,vocab_size,files}, tokenizer_hash,
    vocab_size, shards{split: [{path, num_examples, num_tokens, bytes, sha256}]}``.
    """
    _check_args(max_length, vocab_size, valid_fraction, objective, shard_size, num_proc)
    kind = tokenizer_type or DEFAULT_TOKENIZER_TYPE[objective]
    if kind not in TOKENIZER_TYPES:
        raise DataError(f"tokenizer type must be one of {', '.join(TOKENIZER_TYPES)} (got {kind!r})")
    given = None if tokenizer_path is None else load_tokenizer(tokenizer_path, objective)  # fail fast
    settings = dict(
        max_length=max_length, seed=seed, tokenizer_path=tokenizer_path, vocab_size=vocab_size,
        valid_fraction=valid_fraction, objective=objective, tokenizer_type=kind, shard_size=shard_size,
        num_proc=num_proc,
    )  # fmt: skip

    def build(tmp: Path) -> dict[str, Any]:
        spool = tmp / "documents.jsonl"
        num_documents, tasks = spool_documents(documents, spool, progress)
        if num_documents == 0:
            raise DataError("the corpus is empty: give at least a few paragraphs of text")
        if given is None:
            logger.info(
                "training a %s tokenizer (vocab_size=%d) on %d documents", kind, vocab_size, num_documents
            )
            shown = num_documents if progress else None
            tokenizer = train_tokenizer(read_spool(spool), kind, vocab_size, tmp / TOKENIZER, shown)
            entry = tokenizer_entry(tokenizer, tmp / TOKENIZER, kind)
        else:
            tokenizer = given
            save_tokenizer(tokenizer, tmp / TOKENIZER)
            entry = tokenizer_entry(tokenizer, tmp / TOKENIZER, "given", given=str(tokenizer_path))
        spec = BuildSpec(objective, max_length, seed, valid_fraction, str(tmp / TOKENIZER))
        writers, doc_counts = build_shards(spec, spool, tasks, tmp, shard_size, num_proc, progress)
        spool.unlink()
        return finish_manifest(
            tmp, writers, entry, objective=objective, max_length=max_length, seed=seed,
            valid_fraction=valid_fraction, num_documents=doc_counts,
            source=source or {"kind": "documents"}, config={**settings, **(config or {})},
        )  # fmt: skip

    return write_atomically(out_dir, build)


def _load_split(path: Path, split: str, manifest: dict[str, Any]) -> datasets.Dataset:
    import datasets

    entries = manifest.get("shards", {}).get(split)
    if entries is None:
        raise DataError(f"{path}/{MANIFEST} lists no {split} shards; run `cotrain prepare` again")
    tables = []
    for entry in entries:
        shard = inside(path, entry["path"])
        if not shard.is_file():
            raise DataError(
                f"{path} lacks shard {entry['path']}: it is incomplete; run `cotrain prepare` again"
            )
        tables.append(read_shard(shard, entry))
    sch = schema(manifest["objective"])
    table = pa.concat_tables(tables) if tables else sch.empty_table()
    return datasets.Dataset(table, split=datasets.NamedSplit(split))


def load_prepared(path: str | Path) -> PreparedData:
    """Load a folder written by :func:`prepare_dataset` into memory (shards verified by sha256); the
    splits are formatted as torch tensors. Raises DataError if anything is missing or inconsistent.
    Training reads a prepared dataset shard by shard instead: ``cotrain.data.stream.ExampleStream``."""
    path = Path(path)
    manifest = read_manifest(path)
    loaded = {split: _load_split(path, split, manifest) for split in SPLITS}
    tokenizer = load_tokenizer(path / TOKENIZER, manifest["objective"])
    if tokenizer_hash(tokenizer) != manifest.get("tokenizer_hash"):
        raise DataError(f"the tokenizer in {path} does not match its manifest; run `cotrain prepare` again")
    cols = columns(manifest["objective"])
    return PreparedData(
        train=loaded["train"].with_format("torch", columns=cols),
        validation=loaded["validation"].with_format("torch", columns=cols),
        tokenizer=tokenizer,
        manifest=manifest,
    )
