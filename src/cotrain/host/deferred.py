"""Modules a process imports only when it first uses them.

hivemind's averager imports ``scipy.optimize`` with itself (``hivemind.averaging.load_balancing``), about
40 MB of memory in every peer (23 MB of it the process's own), for one call: the all-reduce solves a linear
program for its parts' sizes only when a peer of the group gave its bandwidth (``--bandwidth``).
``defer(name)`` puts a stand-in for the module in ``sys.modules`` and on its parent package: ``import
scipy.optimize`` finds it and imports nothing, and the first use of one of its attributes imports the real
module (under a lock: the averagers' threads may reach it at the same time) and continues with it. A swarm in
which no peer gives its bandwidth never loads it.

transformers' model code takes one function of it at import time (``from scipy.optimize import
linear_sum_assignment``, for its object-detection losses), which a language model never calls: the names in
``DEFERRED`` are such functions, which the stand-in gives as a function that imports the real module when
it is first called, so a trainer does not load it either.

cotrain's role processes defer ``DEFERRED`` (cotrain._worker) before anything imports hivemind; the Python API
leaves a user's process alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

# module -> functions that importers bind at import time and call later (if ever)
DEFERRED: dict[str, tuple[str, ...]] = {"scipy.optimize": ("linear_sum_assignment",)}

_lock = threading.RLock()  # re-entered: the real module's own import may use its stand-in


class StandIn(types.ModuleType):
    """A module not imported yet: the first attribute asked of it imports the real one."""

    def __init__(self, name: str, functions: tuple[str, ...] = ()) -> None:
        super().__init__(name)
        self.__functions = frozenset(functions)

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):  # probes (inspect.getmodule asks every module for __file__) load nothing
            raise AttributeError(attr)
        if attr in self.__functions:
            return _deferred_function(self.__name__, attr)
        return getattr(load(self.__name__), attr)


def _deferred_function(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported at its first call."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(load(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__module__ = module
    call.__doc__ = f"{module}.{name}, imported at its first call."
    return call


def defer(name: str, functions: tuple[str, ...] = ()) -> bool:
    """Stand in for the module ``name`` until it is used (``functions``: names given as functions that
    import it when called); False where it is imported already or missing."""
    if name in sys.modules:
        return False
    try:
        if importlib.util.find_spec(name) is None:  # imports its parent package (scipy's is small)
            return False
    except ImportError:
        return False
    stand_in = StandIn(name, functions)
    sys.modules[name] = stand_in
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, stand_in)
    return True


def defer_all() -> list[str]:
    """Defer each of ``DEFERRED``; returns those deferred."""
    return [name for name, functions in DEFERRED.items() if defer(name, functions)]


def load(name: str) -> types.ModuleType:
    """The real module ``name``, imported now if its stand-in is all there is (the import system then sets it
    on the parent package in the stand-in's place). While it is being imported, the module as far as it got,
    as the import system gives it to the module's own submodules."""
    with _lock:
        module = sys.modules.get(name)
        if module is None or isinstance(module, StandIn):
            sys.modules.pop(name, None)
            module = importlib.import_module(name)
        return module
