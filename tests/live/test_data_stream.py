"""Prepared datasets served over HTTP.

Here, with cotrain processes; the rest in tests/unit/data/test_data_stream.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import FAST, LOCALHOST, Role, alive, trainer_rows, wait_until
from support.data_stream import Server, shard_paths


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
