"""The one door to hivemind's internals (cotrain.hivemind_ext): nothing else in cotrain uses a private
hivemind name, and a change upstream of any hivemind function cotrain touches is caught and named."""

import ast
import inspect
import logging
from pathlib import Path

import hivemind
import pytest

from cotrain import hivemind_ext as internals
from cotrain.hivemind_ext import manifest

SRC = Path(__file__).resolve().parents[1] / "src" / "cotrain"


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


def test_no_private_hivemind_name_outside_the_door():
    private = _hivemind_private_names()
    assert {"_p2p", "_run_allreduce_inplace_", "_outer_pipe"} <= private  # the scan sees them
    found = []
    for path in SRC.rglob("*.py"):
        if "internals" in path.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used = [node.attr]
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                used = [node.name]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hivemind"):
                used = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.relative_to(SRC)}:{node.lineno} {name}" for name in used if name in private]
    assert not found, "hivemind's private names belong in cotrain.hivemind_ext:\n" + "\n".join(found)


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
        "cotrain.hivemind_ext.hooks.Averager; cotrain.algorithms.lineage.OuterAverager)"
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

    from cotrain.algorithms.lineage import OuterAverager
    from cotrain.hivemind_ext.hooks import Averager, Optimizer, Runner, Tracker
    from cotrain.hivemind_ext.optimizer import SwarmOptimizer
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
