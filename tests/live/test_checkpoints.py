"""Checkpoints in one process.

Here, with cotrain processes; the rest in tests/unit/test_checkpoints.py."""

from __future__ import annotations

import pytest

from cotrain import checkpoints as ck
from support.checkpoints import save, trained_state


@pytest.mark.slow  # several seconds: the full suite runs it, not the daily "not slow" run
def test_export_refuses_a_folder_it_did_not_make_and_replaces_its_own(tmp_path, tokenizer):
    import subprocess
    import sys

    from conftest import cotrain_env

    path = save(tmp_path / "checkpoints", 5, tokenizer, trained_state(tokenizer, steps=1))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    p = subprocess.run(
        [sys.executable, "-m", "cotrain", "export", str(path), str(mine)],
        capture_output=True, text=True, timeout=120, env=cotrain_env(),
    )  # fmt: skip
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("cotrain export: error:") and "not a cotrain export" in lines[0]
    assert [f.name for f in mine.iterdir()] == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "a user's file"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["checkpoints", "mine"]  # no temp folder left

    out = ck.export(path, tmp_path / "hf")  # an export folder is replaced by the next export
    (out / "model.safetensors").write_bytes(b"from the previous export")
    ck.export(path, out)
    assert (out / "model.safetensors").stat().st_size > 100
    (tmp_path / "empty").mkdir()  # an empty folder is used
    assert (ck.export(path, tmp_path / "empty") / "cotrain.json").is_file()
