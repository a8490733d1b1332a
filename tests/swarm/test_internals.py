"""The wall around hivemind (cotrain.hivemind_ext).

Here, with hivemind in the test process; the rest in tests/unit/hivemind_ext/test_internals.py."""

import ast
import inspect
from pathlib import Path

import hivemind
import pytest

from cotrain import hivemind_ext as internals
from cotrain.hivemind_ext import manifest
from support.internals import (
    SRC,
    WALL,
    _is_hivemind,
    _modules,
    _outside,
    private_uses,
    unpublic_imports,
)


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


def test_no_class_outside_the_wall_subclasses_a_hivemind_class():
    found = hivemind_subclasses(SRC)
    assert not found, "subclasses of hivemind's classes belong in cotrain.hivemind_ext:\n" + "\n".join(found)
    # the scan sees the wall's own: directly, through the hook bases, through mixins
    inside = {line.split(" ", 1)[1] for line in hivemind_subclasses(SRC, outside_only=False)}
    assert "RevocationsValidator <- hivemind.dht.validation.RecordValidatorBase" in inside
    assert "SwarmDHT <- cotrain.hivemind_ext.hooks.DHT <- hivemind.DHT" in inside
    assert any(line.startswith("OuterAverager <- ") for line in inside)


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
