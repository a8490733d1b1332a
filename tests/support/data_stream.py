"""Helpers the test_data_stream tests share across suites."""

from __future__ import annotations

import functools
import http.server
import itertools
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import WIKITEXT, at_least
from cotrain.data import prepare_dataset, read_wikitext

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
