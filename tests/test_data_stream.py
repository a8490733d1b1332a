"""Prepared datasets served over HTTP: lazy, verified, resumable, cached shard downloads, and a real
trainer that starts training before the dataset's second shard is released."""

from __future__ import annotations

import functools
import http.server
import itertools
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import FAST, LOCALHOST, WIKITEXT, Role, alive, at_least, trainer_rows, wait_until
from cotrain.data import AlbertCollator, DataError, ExampleStream, prepare_dataset, read_wikitext
from cotrain.data.fetch import download
from cotrain.data.stream import shard_order

SHARD_SIZE = at_least(40, 10)  # at least 4 shards of WIKITEXT's first 250 paragraphs


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder with HTTP Range support; ``gate(path)`` may block a request until it returns."""

    gate: Callable[[str], None] = staticmethod(lambda path: None)
    requests: list[tuple[str, str | None]]

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.requests.append((self.path, self.headers.get("Range")))
        self.gate(self.path)
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        path = Path(self.translate_path(self.path))
        if match and path.is_file():
            data = path.read_bytes()[int(match.group(1)) :]
            self.send_response(206)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        super().do_GET()


class Server:
    def __init__(self, root: Path, gate: Callable[[str], None] | None = None) -> None:
        handler = type("H", (Handler,), {"requests": [], "gate": staticmethod(gate or (lambda path: None))})
        self.requests = handler.requests
        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
        )
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(root: Path, gate: Callable[[str], None] | None = None) -> Server:
        servers.append(Server(root, gate))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """WikiText-2 validation articles as sop+mlm examples of up to 128 tokens, 40 per shard."""
    out = tmp_path_factory.mktemp("sharded") / "data"
    docs = list(itertools.islice(read_wikitext(WIKITEXT), 250))
    manifest = prepare_dataset(
        docs, out, max_length=128, seed=0, vocab_size=2000, valid_fraction=0.1, shard_size=SHARD_SIZE
    )
    return out, manifest


def shard_paths(manifest: dict) -> list[str]:
    return [entry["path"] for entry in manifest["shards"]["train"]]


def test_a_stream_reads_and_shuffles_its_shards_without_importing_pandas(demo_data: Path) -> None:
    """pq.read_table (pyarrow.dataset) and pa.array on numpy import pandas: 56 MB more in every trainer."""
    import subprocess
    import sys

    code = (
        "import sys, itertools; from cotrain.data import ExampleStream; "
        f"s = ExampleStream({str(demo_data)!r}, seed=3); rows = list(itertools.islice(iter(s), 300)); "
        "print(len(rows), 'pandas' in sys.modules, 'pyarrow.dataset' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["300", "False", "False"], (out.stdout, out.stderr)


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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_starts_before_the_second_shard_is_served(
    sharded: tuple[Path, dict], serve: Callable[..., Server], tmp_path: Path
) -> None:
    root, manifest = sharded
    shards = set(shard_paths(manifest))
    release = threading.Event()
    served: list[str] = []

    def gate(path: str) -> None:
        name = path.lstrip("/")
        if name in shards:
            if served and name != served[0]:
                assert release.wait(180), "the test never released the second shard"
            served.append(name)

    server = serve(root, gate)
    # one global step fits in any single shard (the sample corpus makes shards of 10, WikiText-2 of 40)
    target = min(16, min(e["num_examples"] for e in manifest["shards"]["train"]))
    micro = max(1, target // 2)
    role = Role(
        ["train", "--preset", "albert-tiny", "--host-maddrs", LOCALHOST, *FAST, "--dataset-url", server.url,
         "--cache-dir", str(tmp_path / "cache"), "--max-steps", "2", "--target-batch-size", str(2 * micro),
         "--per-device-train-batch-size", str(micro), "--output-dir", str(tmp_path / "out")],
        tmp_path / "trainer.log",
    )  # fmt: skip
    try:
        wait_until(lambda: trainer_rows(role), 150, what="the trainer's first optimizer step")
        assert trainer_rows(role)[0]["step"] == 1
        waiting = [p for p, _ in server.requests if p.lstrip("/") in shards and p.lstrip("/") not in served]
        assert len(set(served)) == 1, served  # only the first shard had been served at step 1
        assert waiting, "the trainer had not asked for a second shard yet"
        release.set()
        assert role.proc.wait(timeout=90) == 0, role.text()
        assert [r["step"] for r in trainer_rows(role)] == [1, 2]
        # the request the gate held is answered once released (the server's thread records it then)
        wait_until(lambda: len(set(served)) >= 2, 30, what="the second shard served after the release")
    finally:
        release.set()
        pids = role.tree()
        role.stop()
        wait_until(lambda: not alive(pids), 20, what="no trainer process left")
