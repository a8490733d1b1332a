"""Prepare a corpus into a tokenized SOP dataset on disk, and load it back.

Layout of a prepared folder::

    out_dir/
      manifest.json     what was built and how (see prepare_dataset)
      tokenizer/        save_pretrained output
      examples/         datasets.DatasetDict with "train" and "validation" (save_to_disk)

Everything is built in a temporary folder beside ``out_dir`` and renamed into place at the end, so
an interrupted run leaves no half-written ``out_dir`` (and an existing one is kept until the new one
is complete).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute as pc
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from cotrain.data.albert import EXAMPLE_COLUMNS, MIN_MAX_LENGTH, document_examples
from cotrain.data.corpus import demo_corpus, read_text_files
from cotrain.data.errors import DataError
from cotrain.data.fsutil import replace_dir, temp_dir_beside
from cotrain.data.tokenizer import load_tokenizer, save_tokenizer, tokenizer_hash, train_albert_tokenizer

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
OBJECTIVE = "sop+mlm"
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
EXAMPLES = "examples"
TOKENIZER = "tokenizer"


def example_features() -> datasets.Features:
    small = datasets.Value("int8")
    return datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "token_type_ids": datasets.Sequence(small),
            "attention_mask": datasets.Sequence(small),
            "special_tokens_mask": datasets.Sequence(small),
            "sentence_order_label": small,
        }
    )


@dataclass
class PreparedData:
    """A prepared dataset: both splits formatted as torch tensors, its tokenizer and manifest."""

    train: datasets.Dataset
    validation: datasets.Dataset
    tokenizer: PreTrainedTokenizerFast
    manifest: dict[str, Any]


def document_split(document: str, valid_fraction: float) -> str:
    """The split of a document, "validation" or "train", from a hash of its text: the same document
    always lands on the same side, whatever else is in the corpus."""
    bucket = int.from_bytes(hashlib.sha256(document.encode("utf-8")).digest()[:8], "big") % 1000
    return "validation" if bucket < round(valid_fraction * 1000) else "train"


@contextlib.contextmanager
def _datasets_progress(enabled: bool) -> Iterator[None]:
    was_disabled = datasets.are_progress_bars_disabled()
    if enabled:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_disabled:
            datasets.disable_progress_bars()
        else:
            datasets.enable_progress_bars()


def _spool_documents(documents: Iterable[str], spool: Path, progress: bool) -> int:
    """Write the non-empty documents to a JSON-lines file (the corpus is read once, then re-read
    from disk by the tokenizer trainer and each split) and return how many there were."""
    count = 0
    with spool.open("w", encoding="utf-8") as f:
        for document in tqdm(documents, desc="reading corpus", unit="doc", disable=not progress):
            if not isinstance(document, str):
                raise DataError(f"documents must be strings, got {type(document).__name__}")
            if document.strip():
                f.write(json.dumps(document, ensure_ascii=False) + "\n")
                count += 1
    return count


def _read_spool(spool: str | Path) -> Iterator[str]:
    with open(spool, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _generate_split(
    spool: str, tokenizer_dir: str, split: str, valid_fraction: float, max_length: int, seed: int
) -> Iterator[dict[str, Any]]:
    tokenizer = load_tokenizer(tokenizer_dir)
    for document in _read_spool(spool):
        if document_split(document, valid_fraction) == split:
            yield from document_examples(document, tokenizer, max_length, seed)


def _build_split(
    tmp: Path, split: str, valid_fraction: float, max_length: int, seed: int
) -> datasets.Dataset:
    gen_kwargs = {
        "spool": str(tmp / "documents.jsonl"),
        "tokenizer_dir": str(tmp / TOKENIZER),
        "split": split,
        "valid_fraction": valid_fraction,
        "max_length": max_length,
        "seed": seed,
    }
    try:
        return datasets.Dataset.from_generator(
            _generate_split,
            features=example_features(),
            cache_dir=str(tmp / "cache"),
            gen_kwargs=gen_kwargs,
            split=datasets.NamedSplit(split),
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, DataError):
            raise e.__cause__ from None
        raise
    except ValueError:
        # datasets cannot build a split from a generator that yields nothing
        if next(_generate_split(**gen_kwargs), None) is not None:
            raise
        logger.debug("the %s split has no examples", split)
        return datasets.Dataset.from_dict(
            {column: [] for column in EXAMPLE_COLUMNS}, features=example_features(), split=split
        )


def _split_stats(dataset: datasets.Dataset) -> tuple[int, int]:
    """(number of tokens, number of swapped examples) of one split."""
    if len(dataset) == 0:
        return 0, 0
    table = dataset.data.table
    tokens = pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0
    swapped = pc.sum(table.column("sentence_order_label")).as_py() or 0
    return int(tokens), int(swapped)


def _check_args(max_length: int, vocab_size: int, valid_fraction: float) -> None:
    problems = []
    if max_length < MIN_MAX_LENGTH:
        problems.append(f"max_length must be at least {MIN_MAX_LENGTH} (got {max_length})")
    if vocab_size < 100:
        problems.append(f"vocab_size must be at least 100 (got {vocab_size})")
    if not 0.0 <= valid_fraction < 1.0:
        problems.append(f"valid_fraction must be in [0, 1) (got {valid_fraction})")
    if problems:
        raise DataError("; ".join(problems))


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
) -> dict[str, Any]:
    """Tokenize ``documents`` into SOP examples and save them, the tokenizer and a manifest to
    ``out_dir`` (atomically). Trains a Unigram tokenizer of ``vocab_size`` on the documents unless
    ``tokenizer_path`` is given. Documents are assigned to "train" or "validation" by a hash of their
    text (about ``valid_fraction`` of them go to validation). Returns the manifest:

    ``format_version, objective, max_length, seed, valid_fraction, num_documents{split},
    num_examples{split}, num_tokens{split}, mean_tokens_per_example, sop_swapped_fraction,
    tokenizer_hash, vocab_size``.
    """
    _check_args(max_length, vocab_size, valid_fraction)
    out_dir = Path(out_dir).absolute()
    tmp = temp_dir_beside(out_dir)
    try:
        manifest = _prepare_into(
            documents, tmp, max_length, seed, tokenizer_path, vocab_size, valid_fraction, progress
        )
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "prepared %d train / %d validation examples into %s",
        manifest["num_examples"]["train"],
        manifest["num_examples"]["validation"],
        out_dir,
    )
    return manifest


def _prepare_into(
    documents: Iterable[str],
    tmp: Path,
    max_length: int,
    seed: int,
    tokenizer_path: str | None,
    vocab_size: int,
    valid_fraction: float,
    progress: bool,
) -> dict[str, Any]:
    given_tokenizer = None if tokenizer_path is None else load_tokenizer(tokenizer_path)  # fail fast
    spool = tmp / "documents.jsonl"
    num_documents = _spool_documents(documents, spool, progress)
    if num_documents == 0:
        raise DataError("the corpus is empty: give at least a few paragraphs of text")
    if given_tokenizer is None:
        logger.info("training a tokenizer (vocab_size=%d) on %d documents", vocab_size, num_documents)
        tokenizer = train_albert_tokenizer(_read_spool(spool), vocab_size, tmp / TOKENIZER)
    else:
        tokenizer = given_tokenizer
        save_tokenizer(tokenizer, tmp / TOKENIZER)
    doc_counts = dict.fromkeys(SPLITS, 0)
    for document in _read_spool(spool):
        doc_counts[document_split(document, valid_fraction)] += 1

    with _datasets_progress(progress):
        splits = {split: _build_split(tmp, split, valid_fraction, max_length, seed) for split in SPLITS}
        if len(splits["train"]) == 0:
            raise DataError(
                f"no training examples from {num_documents} documents: SOP needs documents with at "
                "least two sentences"
            )
        if len(splits["validation"]) == 0:
            logger.warning("the validation split is empty; use a larger corpus or a larger valid_fraction")
        datasets.DatasetDict(splits).save_to_disk(str(tmp / EXAMPLES))

    stats = {split: _split_stats(ds) for split, ds in splits.items()}
    num_examples = {split: len(ds) for split, ds in splits.items()}
    total_examples = sum(num_examples.values())
    manifest = {
        "format_version": FORMAT_VERSION,
        "objective": OBJECTIVE,
        "max_length": max_length,
        "seed": seed,
        "valid_fraction": valid_fraction,
        "num_documents": doc_counts,
        "num_examples": num_examples,
        "num_tokens": {split: stats[split][0] for split in SPLITS},
        "mean_tokens_per_example": sum(s[0] for s in stats.values()) / total_examples,
        "sop_swapped_fraction": sum(s[1] for s in stats.values()) / total_examples,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": len(tokenizer),
    }
    del splits
    shutil.rmtree(tmp / "cache", ignore_errors=True)
    spool.unlink()
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset folder, or DataError saying how to get one."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"no prepared dataset at {path}: run `cotrain prepare` first")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise DataError(f"{path} has no {MANIFEST}: it is not a prepared dataset; run `cotrain prepare`")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{manifest_path} is corrupt ({e}); run `cotrain prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(
            f"{path} has data format version {version}, this cotrain reads version {FORMAT_VERSION}; "
            "run `cotrain prepare` again"
        )
    return manifest


def _load_split(examples_dir: Path, split: str, manifest: dict[str, Any]) -> datasets.Dataset:
    expected = manifest.get("num_examples", {}).get(split)
    if expected == 0:  # datasets cannot load an empty split it saved; build it instead
        return datasets.Dataset.from_dict(
            {column: [] for column in EXAMPLE_COLUMNS}, features=example_features(), split=split
        )
    try:
        dataset = datasets.load_from_disk(str(examples_dir / split))
    except (FileNotFoundError, ValueError, OSError, IndexError) as e:
        where, reason = examples_dir / split, type(e).__name__
        raise DataError(f"cannot read {where} ({reason}); run `cotrain prepare` again") from None
    if not isinstance(dataset, datasets.Dataset) or len(dataset) != expected:
        found = len(dataset) if isinstance(dataset, datasets.Dataset) else "no"
        raise DataError(
            f"{examples_dir} has {found} {split} examples, the manifest says {expected}; "
            "run `cotrain prepare` again"
        )
    return dataset


def load_prepared(path: str | Path) -> PreparedData:
    """Load a folder written by :func:`prepare_dataset`; the splits are formatted as torch tensors
    (columns: ``EXAMPLE_COLUMNS``). Raises DataError if anything is missing or inconsistent."""
    path = Path(path)
    manifest = read_manifest(path)
    examples_dir = path / EXAMPLES
    if not (examples_dir / "dataset_dict.json").is_file():
        raise DataError(f"{path} has no {EXAMPLES}/ folder: it is incomplete; run `cotrain prepare` again")
    loaded = {split: _load_split(examples_dir, split, manifest) for split in SPLITS}
    tokenizer = load_tokenizer(path / TOKENIZER)
    if tokenizer_hash(tokenizer) != manifest.get("tokenizer_hash"):
        raise DataError(f"the tokenizer in {path} does not match its manifest; run `cotrain prepare` again")
    columns = list(EXAMPLE_COLUMNS)
    return PreparedData(
        train=loaded["train"].with_format("torch", columns=columns),
        validation=loaded["validation"].with_format("torch", columns=columns),
        tokenizer=tokenizer,
        manifest=manifest,
    )


def prepare_from_source(
    *,
    demo: bool,
    text_files: list[str] | None,
    out_dir: str | Path,
    max_length: int,
    seed: int = 0,
    tokenizer_path: str | None = None,
    vocab_size: int = 8000,
    progress: bool = False,
    valid_fraction: float = 0.02,
) -> dict[str, Any]:
    """Pick the corpus (the built-in demo corpus or text files, exactly one) and prepare it."""
    if demo and text_files:
        raise DataError("give either the demo corpus or text files, not both")
    if not demo and not text_files:
        raise DataError("no corpus: pass text files (WikiText or plain text) or use the demo corpus")
    documents: Iterable[str] = demo_corpus() if demo else read_text_files(list(text_files or []))
    return prepare_dataset(
        documents,
        out_dir,
        max_length=max_length,
        seed=seed,
        tokenizer_path=tokenizer_path,
        vocab_size=vocab_size,
        valid_fraction=valid_fraction,
        progress=progress,
    )
