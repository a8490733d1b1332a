"""The wall around hivemind (cotrain.hivemind_ext).

Here, in the test process alone; the rest in tests/swarm/test_internals.py."""

import importlib
import importlib.util
import inspect
import logging
import pkgutil
import re

import hivemind

from cotrain import hivemind_ext as internals
from cotrain.hivemind_ext import manifest
from support.internals import (
    SRC,
    _hivemind_private_names,
    _is_hivemind,
    _is_module,
    private_uses,
    unpublic_imports,
)


def test_no_private_hivemind_name_outside_the_wall():
    assert {
        "_p2p",
        "_run_allreduce_inplace_",
        "_outer_pipe",
    } <= _hivemind_private_names()  # the scan sees them
    found = private_uses(SRC)
    assert not found, "hivemind's private names belong in cotrain.hivemind_ext:\n" + "\n".join(found)


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


def test_install_warns_on_another_hivemind_version(monkeypatch, caplog):
    monkeypatch.setattr(internals, "_done", [])
    monkeypatch.setattr(hivemind, "__version__", "9.9.9")
    with caplog.at_level(logging.WARNING, logger="cotrain.hivemind_ext"):
        internals.install()
    assert "written for hivemind 1.1.12, found 9.9.9" in caplog.text
    assert "none changed" in caplog.text
