"""The wall around hivemind (cotrain.hivemind_ext): outside it, cotrain uses no private hivemind name,
subclasses no hivemind class and imports only hivemind's public API (manifest.PUBLIC); inside it, every method
that overrides hivemind's and every function copied from hivemind is listed in the manifest with the hash of
its upstream source, so that a change upstream of any function cotrain touches is caught and named."""

import ast
import importlib
import importlib.util
import inspect
import logging
import pkgutil
import re
from pathlib import Path

import hivemind
import pytest

from cotrain import hivemind_ext as internals
from cotrain.hivemind_ext import manifest

SRC = Path(__file__).resolve().parents[1] / "src" / "cotrain"
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


def _imported(module: str, path: Path, tree: ast.Module) -> dict[str, str]:
    """What each name bound by an import anywhere in the module refers to, as a dotted name."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return head and f"{head}.{expr.attr}"
    if isinstance(expr, ast.Subscript):  # Generic[T] and the like
        return _dotted(expr.value)
    return None


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


def hivemind_subclasses(root: Path, outside_only: bool = True) -> list[str]:
    """Classes outside the wall (``outside_only``; else all) whose bases resolve, through imports, re-exports
    and other classes under ``root``, to a hivemind class."""
    modules = _modules(root)
    imports = {name: _imported(name, path, tree) for name, (path, tree) in modules.items()}
    classes: dict[str, tuple[Path, int, list[str]]] = {}
    for module, (path, tree) in modules.items():
        local = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for base in filter(None, map(_dotted, node.bases)):
                head, _, rest = base.partition(".")
                if head in imports[module]:
                    base = imports[module][head] + (f".{rest}" if rest else "")
                elif head in local:
                    base = f"{module}.{base}"
                bases.append(base)
            classes[f"{module}.{node.name}"] = (path, node.lineno, bases)

    def resolve(name: str, seen: frozenset = frozenset()) -> str:
        """A class's dotted name where it is defined (following a module's imports of it)."""
        module, _, attr = name.rpartition(".")
        if name in classes or name in seen or attr not in imports.get(module, {}):
            return name
        return resolve(imports[module][attr], seen | {name})

    def upstream(name: str, seen: frozenset = frozenset()) -> str | None:
        """The chain from ``name`` to the hivemind class it derives from, or None."""
        for base in classes[name][2]:
            base = resolve(base)
            if _is_hivemind(base):
                return base
            if base in classes and base not in seen:
                chain = upstream(base, seen | {name})
                if chain is not None:
                    return f"{base} <- {chain}"
        return None

    found = []
    for name, (path, line, _) in classes.items():
        chain = upstream(name) if _outside(root, path) or not outside_only else None
        if chain is not None:
            found.append(f"{path.relative_to(root)}:{line} {name.rpartition('.')[2]} <- {chain}")
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


def test_no_private_hivemind_name_outside_the_wall():
    assert {
        "_p2p",
        "_run_allreduce_inplace_",
        "_outer_pipe",
    } <= _hivemind_private_names()  # the scan sees them
    found = private_uses(SRC)
    assert not found, "hivemind's private names belong in cotrain.hivemind_ext:\n" + "\n".join(found)


def test_no_class_outside_the_wall_subclasses_a_hivemind_class():
    found = hivemind_subclasses(SRC)
    assert not found, "subclasses of hivemind's classes belong in cotrain.hivemind_ext:\n" + "\n".join(found)
    # the scan sees the wall's own: directly, through the hook bases, through mixins
    inside = {line.split(" ", 1)[1] for line in hivemind_subclasses(SRC, outside_only=False)}
    assert "RevocationsValidator <- hivemind.dht.validation.RecordValidatorBase" in inside
    assert "SwarmDHT <- cotrain.hivemind_ext.hooks.DHT <- hivemind.DHT" in inside
    assert any(line.startswith("OuterAverager <- ") for line in inside)


def test_outside_the_wall_only_hivemind_public_api_is_imported():
    assert manifest.is_public("hivemind.utils") and manifest.is_public("hivemind.proto.auth_pb2")
    assert not manifest.is_public("hivemind.utils.multiaddr") and not manifest.is_public("hivemind.protocol")
    for name, why in manifest.PUBLIC:
        assert _is_module(name.removesuffix(".*")) and why, name
    found = unpublic_imports(SRC)
    assert not found, (
        "import these from hivemind's public API, or re-export them in cotrain.hivemind_ext.unexported:\n"
        + "\n".join(found)
    )


def test_the_checks_report_a_bend_outside_the_wall(tmp_path):
    """A module posing as one outside the wall, with a subclass of a hivemind class (directly and through a
    class of the wall's), a private name and an import beyond the public API: each check reports it; the same
    code inside the wall passes."""
    root = tmp_path / "cotrain"
    (root / WALL).mkdir(parents=True)
    (root / "net").mkdir()
    for package in (root, root / WALL, root / "net"):
        (package / "__init__.py").write_text("")
    (root / WALL / "hooks.py").write_text("import hivemind\n\n\nclass DHT(hivemind.DHT):\n    pass\n")
    bent = (
        "import hivemind.averaging.partition as partition\n"
        "from hivemind.utils import multiaddr\n"
        "from hivemind.utils import get_dht_time\n"
        "from cotrain.hivemind_ext.hooks import DHT\n\n\n"
        "class Reducer(partition.TensorPartReducer):\n    pass\n\n\n"
        "class Served(DHT):\n    pass\n\n\n"
        "class Further(Served):\n    pass\n\n\n"
        "class Plain:\n    pass\n\n\n"
        "def client(p2p):\n    return p2p._client\n"
    )
    (root / "net" / "bent.py").write_text(bent)
    assert [line.split(" ", 1)[1] for line in hivemind_subclasses(root)] == [
        "Reducer <- hivemind.averaging.partition.TensorPartReducer",
        "Served <- cotrain.hivemind_ext.hooks.DHT <- hivemind.DHT",
        "Further <- cotrain.net.bent.Served <- cotrain.hivemind_ext.hooks.DHT <- hivemind.DHT",
    ]
    assert unpublic_imports(root) == [
        "net/bent.py:1 hivemind.averaging.partition",
        "net/bent.py:2 hivemind.utils.multiaddr",
    ]
    assert private_uses(root) == ["net/bent.py:24 _client"]
    (root / "net" / "bent.py").rename(root / WALL / "bent.py")
    assert hivemind_subclasses(root) == unpublic_imports(root) == private_uses(root) == []


def _hivemind_ext_classes() -> list[type]:
    """Every class defined in a module of cotrain.hivemind_ext that derives from a hivemind class."""
    out = []
    for info in pkgutil.iter_modules(internals.__path__):
        module = importlib.import_module(f"{internals.__name__}.{info.name}")
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                if any(_is_hivemind(k.__module__) for k in value.__mro__):
                    out.append(value)
    return out


def overrides() -> dict[str, set[str]]:
    """hivemind method (module.Class.name) -> the cotrain classes (module.Class) whose own method of that name
    overrides it in some hivemind_ext class's method order (mixins included)."""
    out: dict[str, set[str]] = {}
    for cls in _hivemind_ext_classes():
        mro = cls.__mro__
        for i, own in enumerate(mro):
            if not own.__module__.startswith("cotrain."):
                continue
            for name, value in vars(own).items():
                if not (
                    inspect.isfunction(value) or isinstance(value, staticmethod | classmethod | property)
                ):
                    continue
                base = next((k for k in mro[i + 1 :] if _is_hivemind(k.__module__) and name in vars(k)), None)
                if base is not None:
                    target = f"{base.__module__}.{base.__qualname__}.{name}"
                    out.setdefault(target, set()).add(f"{own.__module__}.{own.__qualname__}")
    return out


def test_every_override_of_a_hivemind_method_is_in_the_manifest():
    entries = {touch.target: touch for touch in manifest.MANIFEST}
    found = overrides()
    assert "hivemind.averaging.partition.TensorPartReducer.accumulate_part" in found  # the scan sees them
    assert "hivemind.dht.dht.DHT._shutdown" in found  # through a mixin (hosting.ServedInThread)
    problems = []
    for target, owners in sorted(found.items()):
        touch = entries.get(target)
        if touch is None or touch.how not in ("overridden", "copied", "read", "replaced"):
            problems.append(f"{target} (overridden by {', '.join(sorted(owners))}): no manifest entry")
            continue
        for owner in sorted(owners):
            module, _, name = owner.rpartition(".")
            if not re.search(rf"\b{re.escape(module.rpartition('.')[2])}\.{re.escape(name)}\b", touch.by):
                problems.append(f"{target}: the manifest entry's `by` does not name {owner}")
    assert not problems, "\n".join(problems)


def test_every_copied_function_is_hashed():
    copied = [touch for touch in manifest.MANIFEST if touch.how == "copied"]
    assert "hivemind.averaging.partition.TensorPartReducer.accumulate_part" in {t.target for t in copied}
    for touch in copied:
        assert re.fullmatch("[0-9a-f]{16}", touch.sha), touch.target
        source = manifest.source_of(touch.target)
        assert source is not None and manifest.digest(source) == touch.sha, touch.target


def test_every_touched_hivemind_function_is_as_recorded_and_a_change_is_named(monkeypatch):
    assert hivemind.__version__ == manifest.HIVEMIND_VERSION
    assert manifest.missing() == []
    assert manifest.changed() == []
    assert len({t.target for t in manifest.MANIFEST}) == len(manifest.MANIFEST)  # one entry each
    assert {t.how for t in manifest.MANIFEST} <= {"replaced", "overridden", "copied", "called", "read"}

    # hivemind's averager module as a later release might have it: one line of _aggregate_with_group changed
    import hivemind.averaging.averager as averager_module

    real = inspect.getsource(averager_module)
    line = "group_info: GroupInfo, min_vector_size: int, **kwargs) -> GatheredData:"
    assert line in real
    edited = real.replace(line, line + "\n        await asyncio.sleep(0)  # upstream change", 1)
    assert edited.count("upstream change") == 1

    def getsource(obj):
        return edited if obj is averager_module else real_getsource(obj)

    real_getsource = inspect.getsource
    monkeypatch.setattr(manifest.inspect, "getsource", getsource)
    names = manifest.changed()
    assert names == [
        "hivemind.averaging.averager.DecentralizedAverager._aggregate_with_group (copied by "
        "cotrain.hivemind_ext.hooks.Averager; cotrain.hivemind_ext.outer.OuterAverager)"
    ]
    assert manifest.missing() == []

    # a renamed method: install() refuses to start rather than leave an override that is never called
    edited = real.replace("def _run_internal(", "def _r(")
    monkeypatch.setattr(manifest.inspect, "getsource", getsource)
    assert "hivemind.averaging.averager.DecentralizedAverager._run_internal" in manifest.missing()
    monkeypatch.setattr(internals, "_done", [])
    with pytest.raises(RuntimeError, match="_run_internal"):
        internals.install()


def test_install_warns_on_another_hivemind_version(monkeypatch, caplog):
    monkeypatch.setattr(internals, "_done", [])
    monkeypatch.setattr(hivemind, "__version__", "9.9.9")
    with caplog.at_level(logging.WARNING, logger="cotrain.hivemind_ext"):
        internals.install()
    assert "written for hivemind 1.1.12, found 9.9.9" in caplog.text
    assert "none changed" in caplog.text


def test_the_hooks_reach_hivemind_and_the_overrides_are_called():
    from hivemind.averaging.averager import DecentralizedAverager

    from cotrain.hivemind_ext.hooks import Averager, Optimizer, Runner, Tracker
    from cotrain.hivemind_ext.optimizer import SwarmOptimizer
    from cotrain.hivemind_ext.outer import OuterAverager
    from cotrain.hivemind_ext.progress import RobustProgressTracker
    from cotrain.hivemind_ext.reducers import RobustAllReduceRunner
    from cotrain.hivemind_ext.statecheck import CheckedTrainingStateAverager

    # each private method cotrain overrides resolves to the hook base's, which calls the public hook
    assert OuterAverager._aggregate_with_group is Averager._aggregate_with_group
    assert OuterAverager.aggregate_with_group is not Averager.aggregate_with_group
    assert CheckedTrainingStateAverager._load_state_from_peers is Averager._load_state_from_peers
    assert SwarmOptimizer._update_global_epoch is Optimizer._update_global_epoch
    assert RobustProgressTracker._parse_swarm_progress_data is Tracker._parse_swarm_progress_data
    assert RobustAllReduceRunner._communicate_with_peer is Runner._communicate_with_peer
    # the sync state averager keeps hivemind's protocol names; others are named after their class
    assert CheckedTrainingStateAverager._get_handle_name("ns", "rpc_join_group") == (
        "ns::TrainingStateAverager.rpc_join_group"
    )
    assert OuterAverager._get_handle_name(None, "rpc_join_group") == "OuterAverager.rpc_join_group"
    assert DecentralizedAverager._get_handle_name(None, "x") == "DecentralizedAverager.x"
