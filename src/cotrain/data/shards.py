"""Shards: parquet files of at most ``shard_size`` examples each, described in the manifest by their
path, example and token counts, size in bytes and sha256."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cotrain.data.errors import DataError
from cotrain.data.fsutil import sha256_file

COMPRESSION = "zstd"


class ShardWriter:
    """Collects record batches of one split and writes a shard each time ``shard_size`` examples are
    buffered (memory holds at most one shard)."""

    def __init__(self, root: Path, split: str, schema: pa.Schema, shard_size: int) -> None:
        if shard_size < 1:
            raise DataError(f"shard_size must be positive, got {shard_size}")
        self.root, self.split, self.schema, self.shard_size = root, split, schema, shard_size
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.shards: list[dict[str, Any]] = []
        self.num_examples = self.num_tokens = self.num_swapped = self.max_tokens = 0

    def add(self, batch: pa.RecordBatch | None) -> None:
        if batch is None or batch.num_rows == 0:
            return
        while batch.num_rows:
            take = min(batch.num_rows, self.shard_size - self.pending_rows)
            self.pending.append(batch.slice(0, take))
            self.pending_rows += take
            batch = batch.slice(take)
            if self.pending_rows == self.shard_size:
                self._flush()

    def _flush(self) -> None:
        if not self.pending_rows:
            return
        table = pa.Table.from_batches(self.pending, schema=self.schema)
        self.pending, self.pending_rows = [], 0
        relative = f"{self.split}/{len(self.shards):05d}.parquet"
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression=COMPRESSION)
        lengths = pc.list_value_length(table.column("input_ids"))
        tokens = int(pc.sum(lengths).as_py() or 0)
        self.max_tokens = max(self.max_tokens, int(pc.max(lengths).as_py() or 0))
        if "sentence_order_label" in table.column_names:
            self.num_swapped += int(pc.sum(table.column("sentence_order_label")).as_py() or 0)
        self.num_examples += table.num_rows
        self.num_tokens += tokens
        self.shards.append(
            {
                "path": relative,
                "num_examples": table.num_rows,
                "num_tokens": tokens,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        )

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        return self.shards


def read_shard(path: Path, entry: dict[str, Any], verify: bool = True) -> pa.Table:
    """Read one shard, refusing it (DataError) if its sha256 or size differs from its manifest entry."""
    if verify:
        actual = sha256_file(path)
        if actual != entry["sha256"]:
            raise DataError(
                f"shard {entry['path']} is corrupt: its sha256 is {actual[:12]}..., the manifest says "
                f"{entry['sha256'][:12]}...; delete it (or prepare the dataset again)"
            )
    try:  # (not pq.read_table: that imports pyarrow.dataset and pandas, 56 MB more in every trainer)
        with pq.ParquetFile(path) as shard:
            table = shard.read()
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read shard {path} ({e}); prepare the dataset again") from None
    if table.num_rows != entry["num_examples"]:
        raise DataError(
            f"shard {entry['path']} has {table.num_rows} examples, the manifest says {entry['num_examples']}"
        )
    return table


def take_rows(table: pa.Table, indices: np.ndarray) -> list[dict]:
    """The rows of ``table`` at ``indices``, as dicts. The index array is built from the numpy buffer:
    ``table.take(indices)`` converts it with ``pa.array``, which imports pandas to check its input."""
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    wrapped = pa.Array.from_buffers(pa.int64(), len(indices), [None, pa.py_buffer(indices)])
    return table.take(wrapped).to_pylist()
