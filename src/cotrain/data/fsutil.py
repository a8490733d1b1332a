"""Paths that stay inside their folder, and folders written atomically: built beside the target under a
temporary name, then renamed.

A target that already exists is replaced only when this code made it: it is empty, or it holds the
``marker`` file that every folder of its kind holds (a saved tokenizer's ``tokenizer_config.json``), or,
where the caller gives a stricter test (``why_not``: a prepared dataset's, an export's), that test accepts
it; such a test checks that the folder holds nothing but what cotrain writes there (``foreign_entry``).
Anything else is refused before any work starts, and nothing in it is touched."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cotrain.data.errors import DataError
from cotrain.errors import UserError


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def inside(root: str | Path, *parts: str) -> Path:
    """``root / parts...``, resolved (symbolic links followed), or DataError when it is not strictly inside
    ``root`` (also resolved): for every path built from names that a manifest or a remote host supplies."""
    base = Path(root).resolve()
    path = base.joinpath(*parts).resolve()
    if base not in path.parents:
        raise DataError(f"{'/'.join(parts)!r} points outside {root}: refused")
    return path


def _sibling(target: Path, tag: str) -> Path:
    return target.parent / f".{target.name}.{tag}-{secrets.token_hex(4)}"


WhyNot = Callable[[Path], str | None]  # the reason a folder is not one of ours, or None
NameTest = Callable[[str], bool]  # whether cotrain writes a file of that name


def small_json(path: Path, limit: int) -> Any:
    """The JSON value of the file ``path`` (a folder's marker: a manifest, an export's ``cotrain.json``):
    FileNotFoundError when there is none; ValueError when it is a link, larger than ``limit`` bytes,
    unreadable or not JSON."""
    try:
        if path.is_symlink() or path.stat().st_size > limit:
            raise ValueError(f"{path} is a link or larger than {limit} bytes")
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not readable JSON") from e


def foreign_entry(folder: Path, files: NameTest, folders: Mapping[str, NameTest] | None = None) -> str | None:
    """The first entry of ``folder`` that cotrain does not write there (its path relative to ``folder``), or
    None when it holds nothing else. cotrain writes plain files (no symbolic links) whose names ``files``
    accepts, and the folders named in ``folders``, each holding only plain files whose names that folder's
    test accepts."""
    folders = folders or {}
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink():
            return entry.name
        if entry.name in folders and entry.is_dir():
            for inner in sorted(entry.iterdir()):
                if inner.is_symlink() or not inner.is_file() or not folders[entry.name](inner.name):
                    return f"{entry.name}/{inner.name}"
        elif not (entry.is_file() and files(entry.name)):
            return entry.name
    return None


def check_replaceable(target: Path, marker: str, what: str, why_not: WhyNot | None = None) -> None:
    """Raise UserError unless ``target`` is absent, an empty folder, or a folder that cotrain wrote as
    ``what`` (e.g. "a cotrain export"): one holding ``marker``, or, with ``why_not``, one for which
    ``why_not(target)`` (the reason it is not such a folder, or None) returns None."""
    target = Path(target)
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir() or target.is_symlink():
        raise UserError(f"{target} exists and is not a folder: choose another output folder")
    if not any(target.iterdir()):
        return
    if why_not is not None:
        reason = why_not(target)
    else:
        reason = None if (target / marker).is_file() else f"it has no {marker}"
    if reason is None:
        return
    raise UserError(
        f"{target} is not empty and is not {what} ({reason}): nothing was written; "
        "choose a new or empty folder"
    )


def temp_dir_beside(target: Path) -> Path:
    """Create an empty folder ``.{name}.tmp-XXXXXXXX`` next to ``target`` (with the umask's usual
    permissions, unlike ``tempfile.mkdtemp``)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _sibling(target, "tmp")
        try:
            tmp.mkdir()
        except FileExistsError:
            continue
        return tmp


def replace_dir(
    new: Path, target: Path, marker: str | None = None, what: str = "", why_not: WhyNot | None = None
) -> None:
    """Rename the complete folder ``new`` to ``target``, moving an existing ``target`` aside first
    and deleting it only after the rename succeeded. With ``marker``, an existing ``target`` that
    ``check_replaceable`` refuses is left as it is (UserError)."""
    if marker is not None:
        check_replaceable(target, marker, what, why_not)
    old: Path | None = None
    if target.exists():
        old = _sibling(target, "old")
        target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
