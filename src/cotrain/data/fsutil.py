"""Write folders atomically: build beside the target under a temporary name, then rename.

A target that already exists is replaced only when this code made it: it is empty, or it holds the
``marker`` file that every folder of its kind holds (a dataset's manifest, an export's ``cotrain.json``).
Anything else is refused before any work starts, and nothing in it is touched."""

from __future__ import annotations

import hashlib
import secrets
import shutil
from pathlib import Path

from cotrain.errors import UserError


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _sibling(target: Path, tag: str) -> Path:
    return target.parent / f".{target.name}.{tag}-{secrets.token_hex(4)}"


def check_replaceable(target: Path, marker: str, what: str) -> None:
    """Raise UserError unless ``target`` is absent, an empty folder, or a folder holding ``marker`` (one that
    cotrain wrote as ``what``, e.g. "a cotrain dataset")."""
    target = Path(target)
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir() or target.is_symlink():
        raise UserError(f"{target} exists and is not a folder: choose another output folder")
    if (target / marker).is_file() or not any(target.iterdir()):
        return
    raise UserError(
        f"{target} is not empty and is not {what} (it has no {marker}): nothing was written; "
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


def replace_dir(new: Path, target: Path, marker: str | None = None, what: str = "") -> None:
    """Rename the complete folder ``new`` to ``target``, moving an existing ``target`` aside first
    and deleting it only after the rename succeeded. With ``marker``, an existing ``target`` that
    ``check_replaceable`` refuses is left as it is (UserError)."""
    if marker is not None:
        check_replaceable(target, marker, what)
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
