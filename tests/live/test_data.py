"""Tests of cotrain.data.

Here, with cotrain processes; the rest in tests/unit/data/test_data.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow  # several seconds: the full suite runs it, not the daily "not slow" run
@pytest.mark.parametrize("progress", [True, False])
def test_tokenizer_training_shows_progress_only_when_asked(progress: bool, tmp_path: Path) -> None:
    """`cotrain prepare` shows the tokenizer trainer's progress bars on a terminal like its other stages."""
    import os
    import pty
    import subprocess
    import sys

    code = (
        "import sys; from cotrain.data import demo_corpus, train_tokenizer; docs = demo_corpus()[:300]; "
        f"train_tokenizer(docs, sys.argv[1], 600, sys.argv[2], progress=len(docs) if {progress} else None)"
    )
    for kind in ("unigram", "bpe"):
        leader, follower = pty.openpty()  # the trainer draws its bars only on a terminal
        proc = subprocess.Popen(
            [sys.executable, "-c", code, kind, str(tmp_path / kind)], stderr=follower, stdout=follower
        )
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        os.close(leader)
        assert proc.wait(timeout=120) == 0, out.decode(errors="replace")
        shown = "Pre-processing sequences" in out.decode(errors="replace")
        assert shown == progress, (kind, out[-500:])
        assert (tmp_path / kind / "tokenizer.json").is_file()
