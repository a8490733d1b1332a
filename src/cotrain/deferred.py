"""Modules a process imports only when it first uses them.

hivemind's averager imports ``scipy.optimize`` with itself (``hivemind.averaging.load_balancing``), about
40 MB of memory in every peer (23 MB of it the process's own), for one call: the all-reduce solves a linear
program for its parts' sizes only when a peer of the group gave its bandwidth (``--bandwidth``).
``defer(name)`` puts a stand-in for the module in ``sys.modules`` and on its parent package: ``import
scipy.optimize`` finds it and imports nothing, and the first use of one of its attributes imports the real
module (under a lock: the averagers' threads may reach it at the same time) and continues with it. A swarm in
which no peer gives its bandwidth never loads it.

cotrain's role processes defer ``DEFERRED`` (cotrain._worker) before anything imports hivemind; the Python API
leaves a user's process alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

DEFERRED = ("scipy.optimize",)

_lock = threading.RLock()  # re-entered: the real module's own import may use its stand-in


class StandIn(types.ModuleType):
    """A module not imported yet: the first attribute asked of it imports the real one."""

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):  # probes (inspect.getmodule asks every module for __file__) load nothing
            raise AttributeError(attr)
        return getattr(load(self.__name__), attr)


def defer(name: str) -> bool:
    """Stand in for the module ``name`` until it is used; False where it is imported already or missing."""
    if name in sys.modules:
        return False
    try:
        if importlib.util.find_spec(name) is None:  # imports its parent package (scipy's is small)
            return False
    except ImportError:
        return False
    stand_in = StandIn(name)
    sys.modules[name] = stand_in
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, stand_in)
    return True


def defer_all() -> list[str]:
    """Defer each of ``DEFERRED``; returns those deferred."""
    return [name for name in DEFERRED if defer(name)]


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
