"""Download files over HTTP(S): resumable (a ``.part`` file continued with a Range request),
verified by sha256 when the expected hash is known, capped in size when a cap is given, and renamed into
place only when complete."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from pathlib import Path

from tqdm.auto import tqdm

from cotrain.data.errors import DataError
from cotrain.data.fsutil import sha256_file

logger = logging.getLogger(__name__)

CHUNK = 1 << 16
TIMEOUT = 60.0


class HashMismatch(DataError):
    """A downloaded file's sha256 differs from the expected one."""


class TooLarge(DataError):
    """A server sent (or announced) more bytes than the file may have; nothing of it is kept."""


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def _announced(response: object) -> int | None:
    try:
        value = int(response.headers.get("Content-Length"))  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return None
    return value if value >= 0 else None


def is_url(source: str | Path) -> bool:
    return isinstance(source, str) and source.startswith(("http://", "https://"))


def fetch_bytes(url: str, max_bytes: int, timeout: float = TIMEOUT) -> bytes:
    """The body of a small file (a manifest), at most ``max_bytes`` long (TooLarge beyond: reading stops
    there); DataError if it cannot be had."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            announced = _announced(response) or 0
            data = b"" if announced > max_bytes else response.read(max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataError(f"cannot download {url} ({e})") from None
    if announced > max_bytes or len(data) > max_bytes:
        raise TooLarge(f"{url} is larger than {_size(max_bytes)}, the most it may be: refused")
    return data


def _download_once(
    url: str, part: Path, progress: bool, desc: str, timeout: float, max_bytes: int | None
) -> None:
    have = part.stat().st_size if part.exists() else 0
    if max_bytes is not None and have > max_bytes:  # left by an earlier attempt with another cap
        part.unlink()
        have = 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the .part is already complete (or longer than the file)
            return
        raise
    with response:
        if have and response.status != 206:  # the server ignores Range: start over
            have = 0
        announced = _announced(response)
        total = announced + have if announced is not None else None
        too_large = TooLarge(f"{url} is larger than {_size(max_bytes or 0)}, the most it may be: refused")
        if max_bytes is not None and total is not None and total > max_bytes:
            raise too_large
        with (
            part.open("ab" if have else "wb") as f,
            tqdm(
                total=total, initial=have, desc=desc, unit="B", unit_scale=True, disable=not progress
            ) as bar,
        ):
            while block := response.read(CHUNK):
                if max_bytes is not None and have + len(block) > max_bytes:
                    raise too_large
                f.write(block)
                have += len(block)
                bar.update(len(block))


def download(
    url: str,
    dest: Path,
    *,
    sha256: str | None = None,
    progress: bool = False,
    attempts: int = 3,
    timeout: float = TIMEOUT,
    max_bytes: int | None = None,
) -> Path:
    """Download ``url`` to ``dest`` through ``dest.part`` (continued where a previous attempt stopped)
    and rename it when complete and, if ``sha256`` is given, verified. A mismatching file is deleted
    and fetched again from scratch once; a second mismatch raises HashMismatch. Network errors are
    retried ``attempts`` times, then raised as DataError. With ``max_bytes``, a file that turns out (or is
    announced) to be longer stops the download at once: the ``.part`` file is deleted and TooLarge raised."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    mismatches = 0
    failures = 0
    while True:
        try:
            _download_once(url, part, progress, dest.name, timeout, max_bytes)
        except TooLarge:
            part.unlink(missing_ok=True)
            raise
        except (urllib.error.URLError, OSError, ValueError) as e:
            failures += 1
            if failures >= attempts:
                raise DataError(f"cannot download {url} after {attempts} attempts ({e})") from None
            logger.warning("downloading %s failed (%s); retrying", url, e)
            time.sleep(min(2.0**failures, 10.0))
            continue
        actual = sha256_file(part) if sha256 else None
        if actual == sha256:
            part.replace(dest)
            return dest
        part.unlink(missing_ok=True)
        mismatches += 1
        if mismatches >= 2:
            raise HashMismatch(
                f"{url} does not match its sha256 in the manifest (got {actual[:12]}..., expected "
                f"{sha256[:12]}...): the served copy is corrupt; ask its host to prepare it again"
            )
        logger.warning("%s does not match its sha256; downloading it again", url)
