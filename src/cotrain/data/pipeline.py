"""Turn a spooled corpus into shards with ``num_proc`` worker processes, in bounded memory.

The corpus is first spooled to a JSON-lines file (one document a line) and cut into tasks of about
``TASK_BYTES`` each, given to workers as byte ranges of that file: a worker reads its documents,
tokenizes them in one batch and returns Arrow record batches. Results are consumed in task order, so
the output does not depend on ``num_proc``; at most ``4 * num_proc`` tasks are in flight, so memory
does not grow with the corpus.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cotrain.data.errors import DataError
from cotrain.data.objectives import SPLITS, BlockPacker, BuildSpec, encode_documents, schema
from cotrain.data.shards import ShardWriter
from cotrain.data.split import document_split
from cotrain.data.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

TASK_BYTES = 256 * 1024
_WORKER: dict[str, Any] = {}  # per worker process: the spec and its tokenizer, set by _init_worker


def spool_documents(
    documents: Iterable[str], spool: Path, progress: bool
) -> tuple[int, list[tuple[int, int]]]:
    """Write the non-empty documents to a JSON-lines file; return their number and the byte ranges
    of the tasks (about ``TASK_BYTES`` each)."""
    count, tasks, start = 0, [], 0
    with spool.open("wb") as f:
        for document in tqdm(documents, desc="reading corpus", unit="doc", disable=not progress):
            if not isinstance(document, str):
                raise DataError(f"documents must be strings, got {type(document).__name__}")
            if document.strip():
                f.write(json.dumps(document, ensure_ascii=False).encode("utf-8") + b"\n")
                count += 1
                if f.tell() - start >= TASK_BYTES:
                    tasks.append((start, f.tell()))
                    start = f.tell()
        if f.tell() > start:
            tasks.append((start, f.tell()))
    return count, tasks


def read_spool(spool: str | Path, start: int = 0, end: int | None = None) -> Iterator[str]:
    with open(spool, "rb") as f:
        f.seek(start)
        data = f.read() if end is None else f.read(end - start)
    for line in data.splitlines():
        yield json.loads(line)


def _init_worker(spec: BuildSpec, spool: str) -> None:
    _WORKER.update(spec=spec, spool=spool, tokenizer=load_tokenizer(spec.tokenizer_dir, spec.objective))


def _run_task(task: tuple[int, int]) -> tuple[dict[str, Any], dict[str, int]]:
    spec: BuildSpec = _WORKER["spec"]
    documents = list(read_spool(_WORKER["spool"], *task))
    sides = [document_split(d, spec.valid_fraction) for d in documents]
    counts = {split: sides.count(split) for split in SPLITS}
    return encode_documents(documents, sides, _WORKER["tokenizer"], spec), counts


def _results(
    spec: BuildSpec, spool: Path, tasks: list[tuple[int, int]], num_proc: int
) -> Iterator[tuple[dict[str, Any], dict[str, int]]]:
    if num_proc <= 1:
        _init_worker(spec, str(spool))
        try:
            yield from map(_run_task, tasks)
        finally:
            _WORKER.clear()
        return
    # fork: workers start at once and inherit the imported modules; the fast tokenizer turns its
    # own thread pool off in a forked child, which is what we want with one process per core
    context = multiprocessing.get_context("fork")
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with context.Pool(num_proc, initializer=_init_worker, initargs=(spec, str(spool))) as pool:
            pending: deque = deque()
            queue = iter(tasks)
            for task in queue:
                pending.append(pool.apply_async(_run_task, (task,)))
                if len(pending) >= 4 * num_proc:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def build_shards(
    spec: BuildSpec,
    spool: Path,
    tasks: list[tuple[int, int]],
    out: Path,
    shard_size: int,
    num_proc: int,
    progress: bool,
) -> tuple[dict[str, ShardWriter], dict[str, int]]:
    """Encode every task and write the shards of both splits under ``out``; returns the writers
    (closed, with their shard entries and totals) and the number of documents per split."""
    writers = {split: ShardWriter(out, split, schema(spec.objective), shard_size) for split in SPLITS}
    packers = {split: BlockPacker(spec.max_length) for split in SPLITS}
    doc_counts = dict.fromkeys(SPLITS, 0)
    total = tasks[-1][1] if tasks else 0
    with tqdm(total=total, desc="making examples", unit="B", unit_scale=True, disable=not progress) as bar:
        for (start, end), (result, counts) in zip(tasks, _results(spec, spool, tasks, num_proc), strict=True):
            for split in SPLITS:
                doc_counts[split] += counts[split]
                if spec.objective == "clm":
                    writers[split].add(packers[split].add(result[split]))
                else:
                    writers[split].add(result[split])
            bar.update(end - start)
    for writer in writers.values():
        writer.close()
    return writers, doc_counts
