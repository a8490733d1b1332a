"""Files that hold a secret (a peer's identity key, an access token, the swarm's authority key): written
readable by their owner only, and a warning when one that cotrain reads is readable by anyone else.

A file is written to a new temporary file with an unpredictable name, created exclusively (O_CREAT | O_EXCL,
mode 0600), then renamed over the target: it is never half-written, never readable by others, and a file or
symbolic link planted beside it is neither followed nor written through. A file read with group or other
permission bits set (``mode & 0o077``) is still used, with one warning line naming it and the ``chmod`` that
fixes it: another user of the machine may have copied the secret already.
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``, readable by its owner only, through a new temp file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def exposure(path: str | Path) -> str | None:
    """The warning to log when the secret file at ``path`` is readable or writable by its group or others,
    or None (also when it cannot be inspected: reading it reports that)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if not stat.S_ISREG(mode) or not mode & 0o077:
        return None
    return (
        f"{path} is open to other users of this machine (mode {stat.filemode(mode)}): it holds a secret; "
        f"run `chmod 600 {shlex.quote(str(path))}`"
    )


def warn_if_exposed(path: str | Path, what: str) -> bool:
    """Log one warning line when ``path`` (``what`` it is: "identity file", ...) is open to others; return
    whether it is."""
    problem = exposure(path)
    if problem is not None:
        logger.warning(f"The {what} {problem}")
    return problem is not None
