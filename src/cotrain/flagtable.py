"""The README's table of the original recipe's flags, generated from the config fields' metadata.

``python -m cotrain.flagtable README.md`` rewrites the table between its markers;
a test fails when they differ.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from cotrain import config as cfg

START = "<!-- flag-table:start -->"
END = "<!-- flag-table:end -->"


def rows() -> list[tuple[str, str, str, str]]:
    """(original flag, cotrain flag, roles, doc) for every field the original recipe had."""
    out = []
    for cls in cfg.SECTIONS.values():
        for f in dataclasses.fields(cls):
            shown = ("train", "monitor", "prepare", "eval")
            roles = ", ".join(r for r in f.metadata["roles"] if r in shown)
            for seed in cfg.seed_flags(f):  # one row per original spelling
                out.append((seed, cfg.cli_flags(f)[0], roles, f.metadata["doc"]))
    return sorted(out)


def render() -> str:
    lines = [
        START,
        "| original flag | cotrain flag | used by | what it does |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{seed}` | `{flag}` | {roles} | {doc} |" for seed, flag, roles, doc in rows()]
    lines.append(END)
    return "\n".join(lines)


def current(text: str) -> str:
    if START not in text or END not in text:
        return ""
    return text[text.index(START) : text.index(END) + len(END)]


def write(path: Path) -> None:
    text = path.read_text()
    old = current(text)
    text = text.replace(old, render()) if old else text + "\n" + render() + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else "README.md"))
