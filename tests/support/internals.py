"""Helpers the test_internals tests share across suites."""

import ast
import importlib
import importlib.util
from pathlib import Path

import hivemind

from cotrain.hivemind_ext import manifest

SRC = Path(__file__).resolve().parents[2] / "src" / "cotrain"


WALL = "hivemind_ext"


def _hivemind_private_names() -> set[str]:
    """Every name starting with one underscore that hivemind defines or uses as an attribute."""
    names = set()
    for path in Path(hivemind.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.col_offset == 0:
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _modules(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    """Every module under the package directory ``root``, by dotted name (``root``'s name first)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = (path, ast.parse(path.read_text()))
    return out


def _outside(root: Path, path: Path) -> bool:
    return WALL not in path.relative_to(root).parts


def _is_hivemind(name: str) -> bool:
    return name == "hivemind" or name.startswith("hivemind.")


def private_uses(root: Path) -> list[str]:
    """Private hivemind names used in modules outside the wall."""
    private = _hivemind_private_names()
    found = []
    for path, tree in _modules(root).values():
        if not _outside(root, path):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                used = [node.attr]
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                used = [node.name]
            elif isinstance(node, ast.ImportFrom) and _is_hivemind(node.module or ""):
                used = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {name}" for name in used if name in private]
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def unpublic_imports(root: Path) -> list[str]:
    """Imports, outside the wall, of hivemind modules beyond its public API (manifest.PUBLIC)."""
    found = []
    for path, tree in _modules(root).values():
        if not _outside(root, path):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names if _is_hivemind(alias.name)]
            elif isinstance(node, ast.ImportFrom) and not node.level and _is_hivemind(node.module or ""):
                # the module, and any of its names that is itself a submodule (from hivemind.x import y)
                named = [node.module]
                named += [
                    f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")
                ]
            else:
                continue
            found += [
                f"{path.relative_to(root)}:{node.lineno} {n}" for n in named if not manifest.is_public(n)
            ]
    return found
