"""The wandb sink, offline: it starts wandb's own service process."""

from __future__ import annotations

import pytest

from cotrain.sinks import build_sinks


@pytest.mark.timeout(180)
def test_wandb_sink_runs_offline(tmp_path, monkeypatch):
    import gc

    # wandb's import parses class sources with ast (pydantic's docstrings); CPython 3.11 fails that parse when
    # a garbage collection in the middle runs finalizers of earlier tests' objects ("AST constructor
    # recursion depth mismatch"): import it with those collected first and the collector paused
    gc.collect()
    gc.disable()
    try:
        pytest.importorskip("wandb")
    finally:
        gc.enable()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    sinks = build_sinks(tmp_path / "out", "wandb-run", wandb_project="cotrain-test")
    assert len(sinks.sinks) == 2, "the wandb sink did not start"
    for row in ({"step": s, "loss": 6.0 - 0.5 * s, "samples": 64 * s} for s in range(1, 4)):
        sinks.write(row["step"], row)
    sinks.close()
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "out").rglob("*"))
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())
