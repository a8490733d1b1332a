"""Write folders atomically: build beside the target under a temporary name, then rename."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path


def _sibling(target: Path, tag: str) -> Path:
    return target.parent / f".{target.name}.{tag}-{secrets.token_hex(4)}"


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


def replace_dir(new: Path, target: Path) -> None:
    """Rename the complete folder ``new`` to ``target``, moving an existing ``target`` aside first
    and deleting it only after the rename succeeded."""
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
