"""Training examples from a prepared dataset, shard by shard, local or over HTTP(S).

``ExampleStream(source, seed, cache_dir)`` reads the manifest and the tokenizer first (small files),
then yields examples endlessly: shards in a per-peer order (seeded by the peer's seed, a new order
each epoch), examples shuffled within each shard. From a URL (any static HTTP server serving the
prepared folder, e.g. ``python -m http.server``), shards download in a background thread a few
shards ahead of training, each resumable (a ``.part`` file continued with a Range request), verified
by its sha256 from the manifest and cached under its hash, so training starts as soon as the first
shard is there and a second run downloads nothing.

The host of a dataset is not trusted with the machine: its manifest passes a strict schema
(``cotrain.data.manifest``) and a size cap, every cache path built from it is checked to stay in the cache
(``cotrain.data.fsutil.inside``), each shard is downloaded only up to its size in the manifest and each
tokenizer file up to ``MAX_TOKENIZER_FILE_BYTES``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cotrain.data.errors import DataError
from cotrain.data.fetch import TooLarge, download, fetch_bytes, is_url
from cotrain.data.fsutil import inside, sha256_file
from cotrain.data.manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_TOKENIZER_FILE_BYTES,
    TOKENIZER,
    parse_manifest,
    read_manifest,
)
from cotrain.data.shards import read_shard, take_rows
from cotrain.data.tokenizer import load_tokenizer, tokenizer_hash

logger = logging.getLogger(__name__)

ROWS_PER_TAKE = 256  # examples converted to Python at a time (bounds memory for long examples)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cotrain" / "datasets"


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The order in which a peer with ``seed`` reads the shards in ``epoch``."""
    order = list(range(num_shards))
    random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    return order


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def manifest_sha256(source: str | Path) -> str:
    """The sha256 of a prepared dataset's manifest (a folder, or the URL of one: its manifest downloaded,
    size-capped), as a peer that trains with it publishes it."""
    source = str(source)
    if is_url(source):
        base = source if source.endswith("/") else source + "/"
        return hashlib.sha256(fetch_bytes(base + MANIFEST, MAX_MANIFEST_BYTES)).hexdigest()
    return sha256_file(Path(source) / MANIFEST)


class ExampleStream:
    """Endless examples (dicts of lists) of one split of a prepared dataset, in this peer's order.

    ``source`` is a prepared folder or the URL of one. ``manifest``, ``manifest_sha256`` (of its bytes),
    ``tokenizer`` and ``num_examples`` are available once constructed. With ``expected_manifest`` (a sha256,
    the manifest the peer a user was told to join trains with), a downloaded manifest that differs is
    refused before anything it names is fetched. Errors (missing or corrupt shards, an unreachable server)
    are DataErrors, raised where the examples are consumed."""

    def __init__(
        self,
        source: str | Path,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        *,
        split: str = "train",
        prefetch: int = 2,
        progress: bool = False,
        expected_manifest: str = "",
    ) -> None:
        self.source, self.seed, self.split = str(source), seed, split
        self.prefetch, self.progress = prefetch, progress
        self.remote = is_url(self.source)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._fetched: dict[int, Path] = {}
        self._errors: dict[int, DataError] = {}
        self._position = 0
        self._verified: set[int] = set()
        if self.remote:
            self.base = self.source if self.source.endswith("/") else self.source + "/"
            self.cache = Path(cache_dir) if cache_dir else default_cache_dir()
            self.manifest = self._remote_manifest(expected_manifest)
            tokenizer_dir = self._fetch_tokenizer()
        else:
            root = Path(self.source)
            self.manifest = read_manifest(root)
            self.manifest_sha256 = sha256_file(root / MANIFEST)
            tokenizer_dir = root / TOKENIZER
        self.objective: str = self.manifest["objective"]
        self.shards: list[dict[str, Any]] = self.manifest["shards"].get(split) or []
        if not self.shards:
            raise DataError(
                f"the dataset at {self.source} has no {split} examples; prepare it with more text"
            )
        self.tokenizer = load_tokenizer(tokenizer_dir, self.objective)
        if tokenizer_hash(self.tokenizer) != self.manifest["tokenizer_hash"]:
            raise DataError(f"the tokenizer of {self.source} does not match its manifest; prepare it again")
        self.order = shard_order(len(self.shards), seed, 0)
        if self.remote:
            self._thread = threading.Thread(target=self._download_loop, daemon=True, name="shard-downloads")
            self._thread.start()
        else:
            for i, entry in enumerate(self.shards):
                path = inside(root, entry["path"])
                if not path.is_file():
                    raise DataError(f"{root} lacks shard {entry['path']}: it is incomplete; prepare it again")
                self._fetched[i] = path

    @property
    def num_examples(self) -> int:
        return int(self.manifest["num_examples"][self.split])

    # --- remote files ----------------------------------------------------------------------------

    def _remote_manifest(self, expected: str = "") -> dict[str, Any]:
        url = self.base + MANIFEST
        cached = self.cache / "manifests" / f"{hashlib.sha256(url.encode()).hexdigest()[:24]}.json"
        try:
            data = fetch_bytes(url, MAX_MANIFEST_BYTES)
        except TooLarge:
            raise
        except DataError as e:
            if not cached.is_file():
                raise DataError(f"cannot get the dataset's manifest: {e}; is the server up?") from None
            logger.warning("%s; using the manifest cached in %s", e, cached)
            data = cached.read_bytes()
        self.manifest_sha256 = hashlib.sha256(data).hexdigest()
        if expected and self.manifest_sha256 != expected:
            raise DataError(
                f"the dataset manifest at {url} (sha256 {self.manifest_sha256[:12]}) is not the one the peer "
                f"you join trains with ({expected[:12]}): the server, or something between it and you, "
                f"changed it; ask the swarm's operator for the dataset's address (an https:// one is safer)"
            )
        manifest = parse_manifest(data, url)
        _write_atomic(cached, data)
        return manifest

    def _fetch_tokenizer(self) -> Path:
        files: dict[str, str] = self.manifest["tokenizer"]["files"]  # names and hashes checked by the schema
        folder = inside(self.cache, "tokenizers", self.manifest["tokenizer_hash"])
        for name, digest in files.items():
            dest = inside(folder, name)
            if not (dest.is_file() and sha256_file(dest) == digest):
                download(
                    f"{self.base}{TOKENIZER}/{name}", dest, sha256=digest, max_bytes=MAX_TOKENIZER_FILE_BYTES
                )
        return folder

    def _download_loop(self) -> None:
        for position, index in enumerate(self.order):
            with self._cond:
                while position > self._position + self.prefetch and not self._stop.is_set():
                    self._cond.wait(0.5)
            if self._stop.is_set():
                return
            entry = self.shards[index]
            try:
                dest = inside(self.cache, "shards", f"{entry['sha256']}.parquet")
                if not (dest.is_file() and sha256_file(dest) == entry["sha256"]):
                    dest.unlink(missing_ok=True)
                    download(
                        self.base + entry["path"], dest, sha256=entry["sha256"], progress=self.progress,
                        max_bytes=entry["bytes"],
                    )  # fmt: skip
                    logger.info("downloaded shard %s (%d examples)", entry["path"], entry["num_examples"])
                result: Path | DataError = dest
            except DataError as e:
                result = e
            except Exception as e:  # anything else still reaches the consumer as one clear error
                result = DataError(f"cannot download {self.base}{entry['path']} ({type(e).__name__}: {e})")
            with self._cond:
                if isinstance(result, Path):
                    self._fetched[index] = result
                    self._verified.add(index)
                else:
                    self._errors[index] = result
                self._cond.notify_all()

    def _wait_for(self, index: int) -> Path:
        started, warned = time.monotonic(), False
        with self._cond:
            while index not in self._fetched:
                if index in self._errors:
                    raise self._errors[index]
                if self._stop.is_set():
                    raise DataError("the example stream was closed")
                if not warned and time.monotonic() - started > 5:
                    logger.info("waiting for shard %s to download", self.shards[index]["path"])
                    warned = True
                self._cond.wait(0.5)
            return self._fetched[index]

    # --- examples --------------------------------------------------------------------------------

    def _advance(self, position: int) -> None:
        with self._cond:
            self._position = position
            self._cond.notify_all()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for epoch in itertools.count():
            order = self.order if epoch == 0 else shard_order(len(self.shards), self.seed, epoch)
            for position, index in enumerate(order):
                if epoch == 0:
                    self._advance(position)
                entry = self.shards[index]
                table = read_shard(self._wait_for(index), entry, verify=index not in self._verified)
                self._verified.add(index)
                permutation = np.random.default_rng([self.seed, epoch, index]).permutation(table.num_rows)
                for start in range(0, len(permutation), ROWS_PER_TAKE):
                    yield from take_rows(table, permutation[start : start + ROWS_PER_TAKE])
                del table

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> ExampleStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
