"""Where `cotrain prepare` reads from: the built-in demo corpus, local text files, a Hugging Face
dataset by name (or a local data folder in a format ``datasets.load_dataset`` reads), or a dataset the
original recipe already tokenized (a ``save_to_disk`` folder, or a ``.tar``/``.tar.gz`` of one, local
or at a URL), which is imported into cotrain's shards as it is."""

from __future__ import annotations

import logging
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from cotrain.data.albert import EXAMPLE_COLUMNS
from cotrain.data.corpus import demo_corpus, read_text_files
from cotrain.data.dataset import (
    DEFAULT_SHARD_SIZE,
    TOKENIZER,
    check_dataset_replaceable,
    finish_manifest,
    prepare_dataset,
    tokenizer_entry,
    write_atomically,
)
from cotrain.data.errors import DataError
from cotrain.data.fetch import download, is_url
from cotrain.data.objectives import SPLITS, schema
from cotrain.data.shards import ShardWriter
from cotrain.data.tokenizer import load_tokenizer, save_tokenizer

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

WIKITEXT_HEADING_CHARS = "= "


def hf_documents(
    name: str, config: str | None, split: str = "train", text_column: str = "text"
) -> Iterator[str]:
    """Documents of a Hugging Face dataset, streamed (``datasets.load_dataset(name, config,
    streaming=True)``): each non-empty row of ``text_column``; WikiText's ``= heading =`` rows are
    skipped. ``name`` may also be a local folder of parquet/json/csv/text files."""
    import datasets

    from cotrain.data.corpus import _is_wikitext_heading  # deferred: cycle (corpus reads sources)

    try:
        rows = datasets.load_dataset(name, config or None, split=split, streaming=True)
    except Exception as e:  # datasets raises many types: not found, no network, bad config
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"cannot load dataset {name!r} (config {config!r}, split {split!r}): {detail}"
        ) from None
    count = 0
    for row in rows:
        if text_column not in row:
            raise DataError(f"dataset {name!r} has no column {text_column!r} (columns: {', '.join(row)})")
        text = row[text_column]
        if isinstance(text, str) and text.strip() and not _is_wikitext_heading(text):
            count += 1
            yield " ".join(text.split())
    if count == 0:
        raise DataError(f"dataset {name!r} split {split!r} has no text")


def _find_saved_dataset(root: Path) -> Path:
    """The folder under ``root`` (itself, or a descendant) written by ``save_to_disk``."""
    for marker in ("dataset_dict.json", "state.json"):
        hits = sorted(root.rglob(marker), key=lambda p: len(p.parts))
        if hits:
            return hits[0].parent
    raise DataError(f"{root} holds no dataset saved with save_to_disk (no dataset_dict.json or state.json)")


def _local_recipe_folder(source: str, work: Path, progress: bool) -> Path:
    if is_url(source):
        name = source.rstrip("/").rsplit("/", 1)[-1] or "dataset.tar.gz"
        archive = download(source, work / name, progress=progress)
    else:
        archive = Path(source)
        if not archive.exists():
            raise DataError(f"no dataset at {source}: give a save_to_disk folder or a .tar/.tar.gz of one")
        if archive.is_dir():
            return _find_saved_dataset(archive)
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(work / "extracted", filter="data")
    except (tarfile.TarError, OSError) as e:
        raise DataError(
            f"cannot extract {source} ({e}): give a save_to_disk folder or a .tar/.tar.gz"
        ) from None
    return _find_saved_dataset(work / "extracted")


def _recipe_batches(dataset: datasets.Dataset, vocab_size: int) -> Iterator[pa.RecordBatch]:
    missing = [c for c in EXAMPLE_COLUMNS if c not in dataset.column_names]
    if missing:
        raise DataError(f"the recipe's dataset lacks columns {', '.join(missing)}: it is not ALBERT SOP data")
    target = schema("sop+mlm")
    for batch in dataset.data.table.select(list(EXAMPLE_COLUMNS)).to_batches(max_chunksize=1000):
        table = pa.Table.from_batches([batch]).cast(target)
        biggest = pa.compute.max(pa.compute.list_flatten(table.column("input_ids"))).as_py()
        if biggest is not None and biggest >= vocab_size:
            raise DataError(
                f"token id {biggest} is outside the tokenizer's {vocab_size} tokens: wrong --tokenizer?"
            )
        yield from table.to_batches()


def import_recipe(
    source: str,
    out_dir: str | Path,
    *,
    tokenizer_path: str | None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = False,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Import a dataset tokenized by the original recipe (columns input_ids, token_type_ids,
    attention_mask, special_tokens_mask, sentence_order_label) into shards. It holds token ids only, so
    the tokenizer it was made with must be given (``--tokenizer albert-large-v2`` or a folder)."""
    if not tokenizer_path:
        raise DataError(
            "data from the original recipe holds token ids only: give the tokenizer it was made with, "
            "e.g. --tokenizer albert-large-v2 (or a folder written by save_pretrained)"
        )
    import datasets

    tokenizer = load_tokenizer(tokenizer_path, "sop+mlm")
    with tempfile.TemporaryDirectory(prefix="cotrain-recipe-") as work:
        folder = _local_recipe_folder(source, Path(work), progress)
        try:
            loaded = datasets.load_from_disk(str(folder))
        except Exception as e:
            raise DataError(f"cannot read the dataset saved in {folder} ({type(e).__name__}: {e})") from None
        parts = loaded if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        splits = {"train": parts.get("train"), "validation": parts.get("validation")}
        if splits["train"] is None:
            raise DataError(f"the dataset in {source} has no train split (splits: {', '.join(parts)})")

        def build(tmp: Path) -> dict[str, Any]:
            save_tokenizer(tokenizer, tmp / TOKENIZER)
            entry = tokenizer_entry(
                tokenizer, tmp / TOKENIZER, "given", given=str(tokenizer_path),
                note="tokenized by the original recipe; the tokenizer was given with --tokenizer",
            )  # fmt: skip
            writers = {split: ShardWriter(tmp, split, schema("sop+mlm"), shard_size) for split in SPLITS}
            for split, dataset in splits.items():
                for batch in _recipe_batches(dataset, len(tokenizer)) if dataset is not None else ():
                    writers[split].add(batch)
                writers[split].close()
            longest = max(w.max_tokens for w in writers.values())
            return finish_manifest(
                tmp, writers, entry, objective="sop+mlm", max_length=longest, seed=0,
                valid_fraction=0.0, num_documents={split: 0 for split in SPLITS},
                source={"kind": "recipe", "location": source},
                config={"shard_size": shard_size, "tokenizer_path": tokenizer_path, **(config or {})},
            )  # fmt: skip

        return write_atomically(out_dir, build)


def prepare_from_source(
    *,
    demo: bool = False,
    text_files: list[str] | None = None,
    dataset: str = "",
    dataset_config: str = "",
    dataset_split: str = "train",
    recipe_data: str = "",
    out_dir: str | Path,
    max_length: int,
    seed: int = 0,
    tokenizer_path: str | None = None,
    vocab_size: int = 8000,
    progress: bool = False,
    valid_fraction: float = 0.02,
    **options: Any,
) -> dict[str, Any]:
    """Pick the source (exactly one of the demo corpus, text files, a dataset by name, or the
    recipe's data) and prepare it; ``options`` go to :func:`prepare_dataset` (objective,
    tokenizer_type, shard_size, num_proc)."""
    given = [n for n, v in (("the demo corpus", demo), ("text files", text_files), ("--dataset", dataset),
                            ("--recipe-data", recipe_data)) if v]  # fmt: skip
    if len(given) > 1:
        raise DataError(f"give one source, not {' and '.join(given)}")
    if not given:
        raise DataError(
            "no corpus: pass --text-files (WikiText or plain text), --dataset NAME, --recipe-data "
            "or --demo-corpus"
        )
    check_dataset_replaceable(Path(out_dir).absolute())  # before reading any corpus
    if recipe_data:
        if options.get("objective", "sop+mlm") != "sop+mlm":
            raise DataError("the original recipe's data holds sop+mlm examples; drop --objective")
        return import_recipe(
            recipe_data, out_dir, tokenizer_path=tokenizer_path, progress=progress,
            shard_size=options.get("shard_size", DEFAULT_SHARD_SIZE),
        )  # fmt: skip
    documents: Iterable[str]
    if demo:
        documents, source = demo_corpus(), {"kind": "demo"}
    elif dataset:
        documents = hf_documents(dataset, dataset_config, dataset_split)
        source = {"kind": "dataset", "name": dataset, "config": dataset_config, "split": dataset_split}
    else:
        files = list(text_files or [])
        documents, source = read_text_files(files), {"kind": "text_files", "files": files}
    return prepare_dataset(
        documents, out_dir, max_length=max_length, seed=seed, tokenizer_path=tokenizer_path,
        vocab_size=vocab_size, valid_fraction=valid_fraction, progress=progress, source=source, **options,
    )  # fmt: skip
