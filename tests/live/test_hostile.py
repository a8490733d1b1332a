"""A hostile dataset host, and files cotrain reads back.

Here, with cotrain processes; the rest in tests/unit/data/test_hostile.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from conftest import LOCALHOST, Role, cotrain_env, monitor_address, monitor_args, wait_until
from support.hostile import CLIMB, PAYLOAD, Host, sha, tree


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_trainer_refuses_a_hostile_host_in_one_line(hosted, tmp_path):
    """`cotrain train --dataset-url` on a manifest whose tokenizer files climb out of the cache."""
    host = hosted(lambda m: m["tokenizer"]["files"].update({CLIMB + "planted.json": sha(PAYLOAD)}))
    cache = tmp_path / "cache"
    out = tmp_path / "out"
    before = tree(tmp_path, cache)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cotrain", "train", "--dataset-url", host.url, "--preset", "albert-tiny",
         "--host-maddrs", LOCALHOST, "--output-dir", str(out), "--cache-dir", str(cache)],
        capture_output=True, text=True, timeout=100, env={**cotrain_env(), "COTRAIN_LOG_COLOR": "0"},
    )  # fmt: skip
    seconds = time.monotonic() - started
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert done.returncode != 0 and "Traceback" not in done.stdout + done.stderr, done.stderr
    assert len(errors) == 1 and errors[0].startswith("cotrain train: error: "), done.stderr
    assert done.stderr.strip().splitlines()[-1] == errors[0] and "tokenizer.files[" in errors[0], done.stderr
    assert seconds < 90, seconds
    after = {p: h for p, h in tree(tmp_path, cache).items() if not (p == str(out) or p.startswith(f"{out}/"))}
    assert after == before and host.requests == ["/manifest.json"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_trainer_takes_only_the_manifest_its_initial_peer_trains_with(hosted, prepared, tmp_path):
    """The monitor's config record carries its dataset manifest's sha256: a trainer that downloads a manifest
    (--dataset-url) that differs from it stops in one line before fetching anything it names; the manifest
    the monitor has passes, said in one line."""
    common = ["--preset", "albert-tiny", "--run-id", "anchored-data", "--host-maddrs", LOCALHOST]
    monitor_line = monitor_args([*common, "--dataset-path", str(prepared)], tmp_path / "m")
    monitor = Role(monitor_line, tmp_path / "m.log")
    honest = None
    try:
        initial = monitor_address(tmp_path / "m", 120)
        # a changed copy: one shard left out (what a host that serves a subset, or one on the path, could do)
        tampered = hosted(lambda m: m["shards"]["train"].pop())
        cache = tmp_path / "cache"
        before = tree(tmp_path, cache)
        train = [sys.executable, "-m", "cotrain", "train", *common, "--initial-peers", *initial]
        done = subprocess.run(
            [*train, "--dataset-url", tampered.url, "--output-dir", str(tmp_path / "t"),
             "--cache-dir", str(cache)],
            capture_output=True, text=True, timeout=150, env={**cotrain_env(), "COTRAIN_LOG_COLOR": "0"},
        )  # fmt: skip
        errors = [line for line in done.stderr.splitlines() if ": error: " in line]
        assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
        assert "is not the one the peer you join trains with" in errors[0], errors
        assert tampered.requests == ["/manifest.json"]  # nothing it names was fetched
        after = tree(tmp_path, cache)
        assert {p: h for p, h in after.items() if not p.startswith(str(tmp_path / "t"))} == before
        # the monitor's own dataset, served as it is: taken, and said so
        host = Host(prepared)
        try:
            honest = Role(
                [*train[3:], "--dataset-url", host.url, "--output-dir", str(tmp_path / "h")]
                + ["--cache-dir", str(tmp_path / "cache2")],
                tmp_path / "h.log",
            )
            wait_until(lambda: "joined run 'anchored-data'" in honest.text(), 150, what="the trainer to join")
            text = honest.text()
            assert "The dataset's manifest is the one initial peer 12D3" in text, text[-3000:]
        finally:
            host.close()
    finally:
        for role in (monitor, honest):
            if role is not None and role.proc.poll() is None:
                role.kill_all()
