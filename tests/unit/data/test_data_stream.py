"""Prepared datasets served over HTTP.

Here, in the test process alone; the rest in tests/live/test_data_stream.py."""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cotrain.data import AlbertCollator, DataError, ExampleStream
from cotrain.data.fetch import download
from cotrain.data.stream import shard_order
from support.data_stream import SHARD_SIZE, Server, shard_paths


def test_stream_from_url_is_per_peer_cached_and_works_offline(
    sharded: tuple[Path, dict], serve: Callable[..., Server], tmp_path: Path
) -> None:
    root, manifest = sharded
    n_shards, n = len(manifest["shards"]["train"]), manifest["num_examples"]["train"]
    assert n_shards >= 4 and all(e["num_examples"] <= SHARD_SIZE for e in manifest["shards"]["train"])
    server = serve(root)
    stream = ExampleStream(server.url, seed=1, cache_dir=tmp_path / "cache")
    assert stream.manifest == manifest and stream.num_examples == n
    assert len(stream.tokenizer) == manifest["vocab_size"]
    examples = list(itertools.islice(iter(stream), n))  # one epoch: every example exactly once
    every = [
        ids for path in shard_paths(manifest) for ids in pq.read_table(root / path)["input_ids"].to_pylist()
    ]
    assert sorted(map(str, (e["input_ids"] for e in examples))) == sorted(map(str, every))
    first = manifest["shards"]["train"][stream.order[0]]["num_examples"]
    local = list(itertools.islice(iter(ExampleStream(root, seed=1)), first))
    assert examples[:first] == local  # the same order from a URL and from a folder
    assert shard_order(n_shards, 1, 0) != shard_order(n_shards, 2, 0)  # per-peer shard orders
    assert shard_order(n_shards, 1, 0) != shard_order(n_shards, 1, 1)  # a new order each epoch
    assert AlbertCollator(stream.tokenizer)(examples[:4])["input_ids"].shape[0] == 4
    stream.close()

    cached = sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir())
    assert cached == sorted(f"{e['sha256']}.parquet" for e in manifest["shards"]["train"])
    server.close()  # the server is gone: the cache serves manifest, tokenizer and shards
    offline = ExampleStream(server.url, seed=1, cache_dir=tmp_path / "cache")
    assert list(itertools.islice(iter(offline), n)) == examples
    offline.close()


def test_corrupt_shard_is_refused(
    sharded: tuple[Path, dict], serve: Callable[..., Server], tmp_path: Path
) -> None:
    root, manifest = sharded
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    victim = bad / manifest["shards"]["train"][0]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    with pytest.raises(DataError, match=r"train/00000.parquet is corrupt: its sha256"):
        list(itertools.islice(iter(ExampleStream(bad, seed=0)), manifest["num_examples"]["train"]))

    server = serve(bad)
    stream = ExampleStream(server.url, seed=0, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"00000.parquet does not match its sha256 in the manifest"):
        list(itertools.islice(iter(stream), manifest["num_examples"]["train"]))
    fetched = [path for path, _ in server.requests if path.endswith("00000.parquet")]
    assert len(fetched) == 2  # fetched again once before refusing it
    assert not any(
        p.name.startswith(manifest["shards"]["train"][0]["sha256"]) for p in (tmp_path / "cache").rglob("*")
    )
    stream.close()


def test_download_resumes_a_part_file(
    sharded: tuple[Path, dict], serve: Callable[..., Server], tmp_path: Path
) -> None:
    root, manifest = sharded
    entry = manifest["shards"]["train"][1]
    content = (root / entry["path"]).read_bytes()
    server = serve(root)
    dest = tmp_path / "shard.parquet"
    (tmp_path / "shard.parquet.part").write_bytes(content[:1000])
    download(server.url + entry["path"], dest, sha256=entry["sha256"])
    assert dest.read_bytes() == content and not (tmp_path / "shard.parquet.part").exists()
    assert server.requests == [(f"/{entry['path']}", "bytes=1000-")]


def test_unreachable_server_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot get the dataset's manifest.*is the server up"):
        ExampleStream("http://127.0.0.1:9/", cache_dir=tmp_path)
