"""Helpers the test_hostile tests share across suites."""

from __future__ import annotations

import functools
import hashlib
import http.server
import itertools
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import WIKITEXT
from cotrain.data import prepare_dataset, read_wikitext

PAYLOAD = b'{"planted": "by the dataset host"}\n'


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder, except the paths in ``routes`` (a body, and whether to announce its length); any
    missing file is answered with PAYLOAD, so that an attack that asks for a made-up path gets a body."""

    routes: dict[str, tuple[bytes, bool]]
    requests: list[str]

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.requests.append(self.path)
        body, announce = self.routes.get(self.path, (None, True))
        if body is None and not Path(self.translate_path(self.path)).is_file():
            body = PAYLOAD
        if body is None:
            return super().do_GET()
        self.send_response(200)
        if announce:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what a cap does
            pass


class Host:
    """A dataset host on 127.0.0.1 serving ``root``."""

    def __init__(self, root: Path) -> None:
        self.routes: dict[str, tuple[bytes, bool]] = {}
        handler = type("H", (Handler,), {"routes": self.routes, "requests": []})
        self.requests: list[str] = handler.requests
        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
        )
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A really prepared tiny dataset (WikiText paragraphs, several shards)."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    docs = list(itertools.islice(read_wikitext(WIKITEXT), 80))
    prepare_dataset(docs, out, max_length=64, seed=0, vocab_size=500, valid_fraction=0.1, shard_size=20)
    return out


@pytest.fixture
def hosted(prepared: Path, tmp_path: Path) -> Iterator[Callable[[Callable[[dict], None]], Host]]:
    """``hosted(rewrite)``: a copy of the prepared dataset, its manifest changed by ``rewrite(manifest)``,
    served on 127.0.0.1 (tmp_path/host)."""
    hosts: list[Host] = []

    def start(rewrite: Callable[[dict], None]) -> Host:
        root = tmp_path / "host"
        shutil.copytree(prepared, root)
        manifest = json.loads((root / "manifest.json").read_text())
        rewrite(manifest)
        (root / "manifest.json").write_text(json.dumps(manifest))
        hosts.append(Host(root))
        return hosts[-1]

    yield start
    for host in hosts:
        host.close()


def tree(root: Path, but: Path) -> dict[str, str]:
    """Every file and folder under ``root`` except ``but`` (the cache) and what is in it: path -> sha256 of
    a file's content ("dir" for a folder, the target for a link)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p == but or but in p.parents:
            continue
        if p.is_symlink():
            out[str(p)] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[str(p)] = "dir"
        else:
            out[str(p)] = sha(p.read_bytes())
    return out


CLIMB = "../../../"  # from the cache's tokenizer folder (tmp_path/cache/tokenizers/HASH/) up to tmp_path
