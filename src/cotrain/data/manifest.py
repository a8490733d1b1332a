"""A prepared dataset's manifest (``manifest.json``, written last by ``cotrain prepare``): read and checked
against a strict schema (pydantic) before anything uses it, without pyarrow, tokenizers or transformers, so
that a role's supervisor checks ``--dataset-path`` cheaply.

A manifest can come from a dataset host the user does not control (``--dataset-url``), so every field that
becomes a path, a URL or a download size is checked here: hashes are 64 lowercase hex characters, tokenizer
file names are one plain path component, shard paths have exactly the shape ``prepare`` writes
(``train/00000.parquet``), counts are non-negative and the lists are bounded. The parsed manifest is handed
on as a plain dict (what callers index)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from cotrain.data.errors import DataError
from cotrain.data.fsutil import foreign_entry, small_json

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer"
SPLITS = ("train", "validation")
# 16 MiB: a shard's entry takes about 230 bytes of the indented JSON, so MAX_SHARDS entries need about 11.5
# MiB; the rest is room for the source and config sections. A manifest is read whole into memory, so a host
# must not be able to make that unbounded.
MAX_MANIFEST_BYTES = 16 << 20
# 50,000 shards of the default 10,000 examples are 500 million examples, far more than WikiText-103 gives.
MAX_SHARDS = 50_000
MAX_TOKENIZER_FILES = 32
# 64 MiB per tokenizer file: the largest common tokenizer.json files (Gemma's, about 34 MB) fit twice.
MAX_TOKENIZER_FILE_BYTES = 64 << 20

SHARD_NAME = r"[0-9]{5,6}\.parquet"  # ShardWriter's names: 00000.parquet ... (MAX_SHARDS fits in 6 digits)


def matching(pattern: str, what: str) -> Callable[[str], str]:
    """A pydantic AfterValidator: the whole string matches ``pattern``, else "must be ``what``"."""

    def check(value: str) -> str:
        if not re.fullmatch(pattern, value):
            raise ValueError(f"must be {what}")
        return value

    return check


Sha256 = Annotated[str, AfterValidator(matching(r"[0-9a-f]{64}", "a sha256: 64 lowercase hex characters"))]
# one plain path component: no separator, no "." or "..", nothing empty, no NUL or control character
FileName = Annotated[
    str,
    AfterValidator(
        matching(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", "one plain file name (letters, digits, '.', '_', '-')")
    ),
]
ShardPath = Annotated[
    str,
    AfterValidator(matching(rf"(train|validation)/{SHARD_NAME}", "SPLIT/NNNNN.parquet, as prepare writes")),
]
Count = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SplitCounts(_Strict):
    train: Count
    validation: Count


class ShardEntry(_Strict):
    path: ShardPath
    num_examples: Count
    num_tokens: Count
    bytes: Annotated[int, Field(ge=1)]
    sha256: Sha256


class Shards(_Strict):
    train: Annotated[list[ShardEntry], Field(max_length=MAX_SHARDS)]
    validation: Annotated[list[ShardEntry], Field(max_length=MAX_SHARDS)]

    @model_validator(mode="after")
    def _each_in_its_split(self) -> Shards:
        if len(self.train) + len(self.validation) > MAX_SHARDS:
            raise ValueError(f"more than {MAX_SHARDS} shards")
        for split in SPLITS:
            for entry in getattr(self, split):
                if not entry.path.startswith(f"{split}/"):
                    raise ValueError(f"shard {entry.path!r} is listed under {split}")
        return self


class TokenizerEntry(_Strict):
    path: Literal["tokenizer"]
    type: Annotated[str, StringConstraints(max_length=64)]
    hash: Sha256
    vocab_size: Annotated[int, Field(ge=1)]
    files: Annotated[dict[FileName, Sha256], Field(min_length=1, max_length=MAX_TOKENIZER_FILES)]
    given: str | None = None
    note: str | None = None

    @model_validator(mode="after")
    def _has_its_own_file(self) -> TokenizerEntry:
        if "tokenizer.json" not in self.files:  # a fast tokenizer's own file: nothing else is loaded
            raise ValueError("lists no tokenizer.json")
        return self


class Manifest(_Strict):
    """What ``cotrain.data.dataset.finish_manifest`` writes, field for field."""

    format_version: Literal[2]
    objective: Literal["sop+mlm", "mlm", "clm"]
    max_length: Annotated[int, Field(ge=1)]
    seed: int
    valid_fraction: Annotated[float, Field(ge=0.0, lt=1.0)]
    source: dict[str, Any]
    config: dict[str, Any]
    columns: Annotated[list[str], Field(min_length=1, max_length=16)]
    num_documents: SplitCounts
    num_examples: SplitCounts
    num_tokens: SplitCounts
    mean_tokens_per_example: Annotated[float, Field(ge=0.0)]
    sop_swapped_fraction: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    tokenizer: TokenizerEntry
    tokenizer_hash: Sha256
    vocab_size: Annotated[int, Field(ge=1)]
    shards: Shards

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.tokenizer_hash != self.tokenizer.hash:
            raise ValueError("tokenizer_hash differs from tokenizer.hash")
        for split in SPLITS:
            listed = sum(entry.num_examples for entry in getattr(self.shards, split))
            if listed != getattr(self.num_examples, split):
                raise ValueError(f"num_examples.{split} differs from the sum of its shards' ({listed})")
        return self


def _field(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as one short printable name: ``tokenizer.files['../x'] (name)``."""
    out = ""
    for part in loc:
        if part == "[key]":
            out += " (name)"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{repr(part)[:80]}]"
    return out


def first_problem(e: ValidationError) -> str:
    """A pydantic error as one line: the first problem's field and what is wrong with it."""
    error = e.errors(include_url=False)[0]
    more = e.error_count() - 1
    message = error["msg"].removeprefix("Value error, ")
    field = _field(error["loc"])
    return (f"{field}: {message}" if field else message) + (f" (and {more} more problems)" if more else "")


def parse_manifest(data: bytes | str, where: str) -> dict[str, Any]:
    """A manifest from its JSON text, checked for this cotrain's format version and against the schema;
    DataError (one line naming the offending field) otherwise."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise DataError(
            f"{where} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: it is not a cotrain manifest"
        )
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{where} is corrupt ({e}); run `cotrain prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(
            f"{where} has data format version {str(version)[:20]}, this cotrain reads version "
            f"{FORMAT_VERSION}; run `cotrain prepare` again"
        )
    try:
        parsed = Manifest.model_validate(manifest)
    except ValidationError as e:
        raise DataError(
            f"{where} is not a valid cotrain manifest: {first_problem(e)}; prepare the dataset again"
        ) from None
    return parsed.model_dump(exclude_unset=True)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset folder, or DataError saying how to get one."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"no prepared dataset at {path}: run `cotrain prepare` first")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise DataError(f"{path} has no {MANIFEST}: it is not a prepared dataset; run `cotrain prepare`")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise DataError(
            f"{manifest_path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: it is not a manifest"
        )
    return parse_manifest(manifest_path.read_bytes(), str(path))


def why_not_prepared(folder: Path) -> str | None:
    """None when ``folder`` is one that ``cotrain prepare`` wrote (so that it may replace it): its
    ``manifest.json`` is a JSON object with a ``format_version`` (any version), and it holds nothing but what
    ``prepare`` writes: the manifest, ``tokenizer/`` (files) and ``train/``, ``validation/`` (shards).
    Otherwise the reason, in a few words."""
    manifest = folder / MANIFEST
    try:
        content = small_json(manifest, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return f"it has no {MANIFEST}"
    except ValueError:
        return f"its {MANIFEST} is not a cotrain manifest"
    version = content.get("format_version") if isinstance(content, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        return f"its {MANIFEST} has no format_version"
    # what `prepare` writes: the manifest, the tokenizer's files and the splits' shards
    shards = dict.fromkeys(SPLITS, lambda name: re.fullmatch(SHARD_NAME, name) is not None)
    stray = foreign_entry(folder, lambda name: name == MANIFEST, {TOKENIZER: bool, **shards})
    if stray is not None:
        return f"it holds {stray!r}, which `cotrain prepare` does not write"
    return None
