"""Helpers the test_auth tests share across suites."""

from __future__ import annotations

from pathlib import Path

from cotrain.cli import main

RUN = "private-test"


def issue(tmp_path: Path, name: str, days: float = 30.0, key: str = "authority.key") -> Path:
    out = tmp_path / f"{name}.token"
    assert (
        main(
            [
                "token",
                "issue",
                "--name",
                name,
                "--valid-days",
                str(days),
                "--authority-key",
                str(tmp_path / key),
                "--output",
                str(out),
            ]
        )
        == 0
    )
    return out
