"""What a user sees when a role cannot start.

Here, with cotrain processes; the rest in tests/unit/roles/test_roles_errors.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import LOCALHOST, cotrain_env
from support.roles_errors import _dataset_for

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
