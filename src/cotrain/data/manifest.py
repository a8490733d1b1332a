"""A prepared dataset's manifest (``manifest.json``, written last by ``cotrain prepare``): read and checked
with the standard library alone, so that a role's supervisor checks ``--dataset-path`` without importing
pyarrow, tokenizers or transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cotrain.data.errors import DataError

FORMAT_VERSION = 2
MANIFEST = "manifest.json"


def parse_manifest(data: bytes | str, where: str) -> dict[str, Any]:
    """A manifest from its JSON text, checked for this cotrain's format version."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{where} is corrupt ({e}); run `cotrain prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise DataError(
            f"{where} has data format version {version}, this cotrain reads version {FORMAT_VERSION}; "
            "run `cotrain prepare` again"
        )
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset folder, or DataError saying how to get one."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"no prepared dataset at {path}: run `cotrain prepare` first")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise DataError(f"{path} has no {MANIFEST}: it is not a prepared dataset; run `cotrain prepare`")
    return parse_manifest(manifest_path.read_bytes(), str(path))
