"""The docs name what exists: every module path and dotted ``cotrain.`` name in README.md and docs/*.md is in
the repository, and every ``cotrain ...`` command line of their bash blocks parses with the CLI's own parser
(parsed and resolved, never run)."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from cotrain import cli

REPO = Path(__file__).resolve().parents[2]


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# a path inside the repository: src/..., cotrain/... (the package), or another top-level folder of it
PATH = re.compile(r"(?<![\w./-])(?:\.\./)?(?:src|cotrain|benchmarks|tests|examples|docs)/[\w./-]*\w")


DOTTED = re.compile(r"(?<![\w./-])cotrain(?:\.[A-Za-z_]\w*){2,}")


BASH = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.S)


def mentions(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted({(doc.name, m.group(0)) for doc in DOCS for m in pattern.finditer(doc.read_text())})


def command_lines() -> list[tuple[str, str]]:
    """(document, line) of each `cotrain ...` line in a bash block, continuation lines joined."""
    found = []
    for doc in DOCS:
        for block in BASH.findall(doc.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.strip().removeprefix("$ ")  # a console block's prompt
                if line.startswith("cotrain "):
                    found.append((doc.name, line))
    return found


def test_the_docs_name_paths_and_commands():
    assert len(mentions(PATH)) > 20 and len(mentions(DOTTED)) > 10 and len(command_lines()) > 20


@pytest.mark.parametrize("doc,path", mentions(PATH), ids=lambda v: v)
def test_every_path_in_the_docs_exists(doc: str, path: str):
    where = REPO / "docs" if doc != "README.md" else REPO
    candidates = [where / path, REPO / path.removeprefix("../"), REPO / "src" / path]
    assert any(c.exists() for c in candidates), f"{doc} names {path}, which does not exist"


@pytest.mark.parametrize("doc,name", mentions(DOTTED), ids=lambda v: v)
def test_every_dotted_name_in_the_docs_exists(doc: str, name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"{doc} names {name}: {'.'.join(parts[:i])} has no {attr}"
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"{doc} names {name}, which is not a module")


def arguments(line: str) -> list[str]:
    """The arguments of a documented command line: comments dropped, and an elided part (a bare ``...`` that
    is not an option's value) left out."""
    words = shlex.split(line, comments=True)[1:]
    return [w for i, w in enumerate(words) if w != "..." or (i and words[i - 1].startswith("-"))]


@pytest.mark.parametrize("doc,line", command_lines(), ids=lambda v: v)
def test_every_documented_command_line_parses(doc: str, line: str):
    args = arguments(line)
    ns, _ = cli.parse(args)
    assert ns.command == args[0], f"{doc}: {line}"
