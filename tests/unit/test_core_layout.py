"""The core's layout holds: cotrain's own math imports no hivemind, no module imports another in a cycle,
nothing outside the strategies asks which strategy a run uses, and an import inside a function says why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import cotrain

SRC = Path(cotrain.__file__).resolve().parent


ROOT = SRC.parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _top_level_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The cotrain modules ``name`` imports when it is imported (not under TYPE_CHECKING, not in functions),
    with the packages on the way that are not its own."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    nodes = [n for n in tree.body if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    for node in (m for n in nodes for m in ast.walk(n)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("cotrain"):
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        elif isinstance(node, ast.Import):
            targets |= {a.name for a in node.names if a.name.startswith("cotrain")}
    imported = set()
    for target in targets:
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            prefix = ".".join(parts[:i])
            on_the_way = i < len(parts) and f"{name}.".startswith(f"{prefix}.")
            if prefix in modules and not on_the_way:
                imported.add(prefix)
    imported.discard(name)
    return imported


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_of_cotrain_imports_another_in_a_cycle():
    modules = _modules()
    graph = {name: _top_level_imports(name, path, modules) for name, path in modules.items()}
    assert "cotrain.strategies.base" in graph["cotrain.strategies.sync"]  # the scan sees imports
    assert not _cycles(graph), _cycles(graph)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # and would name a cycle


def test_cotrains_own_math_imports_no_hivemind():
    for path in (SRC / "algorithms").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            assert not any(n.split(".")[0] == "hivemind" for n in names), f"{path.name}:{node.lineno}"


def test_nothing_outside_the_strategies_asks_which_strategy_a_run_uses():
    names = re.compile(r"""["'](sync|diloco)["']""")
    faces = ["roles", "engine", "dashboard", "demo.py", "status.py", "snapshot.py", "faults.py", "net"]
    found = []
    for face in faces:
        paths = [SRC / face] if face.endswith(".py") else sorted((SRC / face).rglob("*.py"))
        for path in paths:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if names.search(code) and '"""' not in code and not code.strip().startswith(("``", "-")):
                    found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "ask the strategy (cotrain.strategies.base.Strategy) instead:\n" + "\n".join(found)


def test_an_import_inside_a_function_says_why():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("cotrain"):
                    said = "#" in lines[inner.end_lineno - 1] or lines[inner.lineno - 2].strip().startswith(
                        "#"
                    )
                    if not said:
                        found.append(
                            f"{path.relative_to(SRC)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}"
                        )
    assert not found, "import at the top of the module, or say why not in a comment:\n" + "\n".join(found)
