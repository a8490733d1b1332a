"""What a user sees when a role cannot start: one line, a non-zero exit, no traceback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import LOCALHOST, cotrain_env

DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t"


def run_cotrain(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "cotrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cotrain_env(),
    )
    return p.returncode, p.stderr + p.stdout, time.monotonic() - t


@pytest.mark.timeout(60)
def test_unreachable_initial_peer_fails_fast_with_one_line():
    rc, out, seconds = run_cotrain("train", "--initial-peers", DEAD_PEER, "--host-maddrs", LOCALHOST)
    assert rc != 0 and seconds < 30
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert "no initial peer could be reached" in lines[0] and "Traceback" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--initial-peers", "1.2.3.4:1337"], "old-style IP:PORT"),
        (["--initial-peers", "/ip4/nonsense"], "malformed initial peer"),
        (["--initial-peers", "/ip4/127.0.0.1/tcp/5"], "lacks its /p2p/"),
        (["--preset", "albert-giant"], "unknown preset"),
        (["--per-device-train-batch-size", "0"], "positive"),
        (["--dataset-path", "/nonexistent/data"], "/nonexistent/data"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_input_is_one_clear_line(args, message):
    rc, out, _ = run_cotrain("train", "--host-maddrs", LOCALHOST, *args)
    lines = [line for line in out.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1, out
    assert message in lines[0] and lines[0].startswith("cotrain train: error:") and "Traceback" not in out


def _dataset_for(tmp_path, preset: str):
    """A prepared-looking dataset folder whose manifest names ``preset`` (the monitor's supervisor reads only
    the manifest before it starts anything)."""
    import json

    folder = tmp_path / f"data-{preset}"
    folder.mkdir()
    counts = {"train": 0, "validation": 0}
    digest = "0" * 64
    manifest = {
        "format_version": 2, "objective": "sop+mlm", "max_length": 128, "seed": 0, "valid_fraction": 0.02,
        "source": {"kind": "demo"}, "config": {"preset": preset}, "columns": ["input_ids"],
        "num_documents": counts, "num_examples": counts, "num_tokens": counts, "mean_tokens_per_example": 0.0,
        "tokenizer": {
            "path": "tokenizer", "type": "unigram", "hash": digest, "vocab_size": 8,
            "files": {"tokenizer.json": digest},
        },
        "tokenizer_hash": digest, "vocab_size": 8, "shards": {"train": [], "validation": []},
    }  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.timeout(60)
def test_a_monitor_whose_preset_disagrees_with_its_dataset_stops_before_it_starts(tmp_path):
    data = _dataset_for(tmp_path, "albert-tiny")
    out = tmp_path / "monitor"
    rc, text, seconds = run_cotrain(
        "monitor", "--preset", "albert-large-v2", "--dataset-path", str(data), "--output-dir", str(out),
        "--host-maddrs", LOCALHOST,
    )  # fmt: skip
    lines = [line for line in text.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, text
    assert "prepared for preset albert-tiny" in lines[0] and "--preset albert-tiny" in lines[0]
    assert not (out / "initial_peers.txt").exists() and not (out / "monitor.log").exists()
    assert seconds < 20


def test_a_monitor_takes_the_preset_of_its_dataset_or_checkpoint_when_none_is_named(tmp_path):
    import json

    import cotrain.config as cfg
    from cotrain.errors import UserError
    from cotrain.preflight import monitor_preset

    data = _dataset_for(tmp_path, "albert-tiny")
    unnamed = cfg.resolve(overrides={"peer": {"dataset_path": str(data)}})
    assert unnamed.run.preset == "albert-large-v2" and "preset" not in unnamed.run_given
    assert monitor_preset(unnamed) == ("albert-tiny", f"the dataset at {data}")
    same = cfg.resolve("albert-tiny", overrides={"peer": {"dataset_path": str(data)}})
    assert monitor_preset(same) is None
    # the same dataset served over HTTP (127.0.0.1): its manifest is read before anything starts
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(data))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        served = cfg.resolve(overrides={"peer": {"dataset_url": url}})
        assert monitor_preset(served) == ("albert-tiny", f"the dataset at {url}")
        with pytest.raises(UserError, match="prepared for preset albert-tiny, this monitor runs preset gpt2"):
            monitor_preset(cfg.resolve("gpt2-tiny", overrides={"peer": {"dataset_url": url}}))
    finally:
        server.shutdown()
        server.server_close()
    # --resume: the newest checkpoint's config names the preset (a folder that says nothing is passed over)
    out = tmp_path / "out"
    for step, preset in ((3, "gpt2-tiny"), (6, None)):
        folder = out / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        meta = {"config": {"run": {"preset": preset}}} if preset else {"step": step}
        (folder / "checkpoint.json").write_text(json.dumps(meta))
    resume = {"peer": {"resume": True, "output_dir": str(out)}}
    assert monitor_preset(cfg.resolve(overrides=resume))[0] == "gpt2-tiny"
    with pytest.raises(UserError, match="made with preset gpt2-tiny, this monitor runs preset albert-tiny"):
        monitor_preset(cfg.resolve("albert-tiny", overrides=resume))
