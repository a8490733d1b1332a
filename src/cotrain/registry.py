"""The registries of the parts a run chooses by name: training strategies (``--strategy``) and all-reduce
aggregations (``--aggregation``). The run's config reads its choices here; the engine builds the part a
name stands for. Each entry is a class or the ``"module:Class"`` path of one (imported on first use, so that
reading the names imports no torch or hivemind).

A new strategy is a class with the methods of ``cotrain.strategies.base.Strategy`` in a module of its own,
and one line here (or a call of ``register_strategy`` before the run's config is checked, e.g. in a script
of one's own); a new aggregation is a subclass of ``cotrain.algorithms.aggregation.Aggregation`` and one line
(or ``register_aggregation``). Every peer of a run must know the part its config names.
"""

from __future__ import annotations

import importlib

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "aggregation_class",
    "register_aggregation",
    "register_strategy",
    "strategy_class",
]

DEFAULT_STRATEGY = "sync"  # the seed recipe's
STRATEGIES: dict[str, type | str] = {
    "sync": "cotrain.strategies.sync:SyncStrategy",
    "diloco": "cotrain.strategies.diloco:DiLoCoStrategy",
}
AGGREGATIONS: dict[str, type | str] = {
    "mean": "cotrain.algorithms.aggregation:Mean",
    "centered-clip": "cotrain.algorithms.aggregation:CenteredClip",
}


def _register(registry: dict[str, type | str], what: str, name: str, part: type | str) -> None:
    if not name or not isinstance(name, str) or name != name.strip() or "." in name:
        raise ValueError(f"a {what} name must be a non-empty word without dots, got {name!r}")
    if name in registry and registry[name] != part:
        raise ValueError(f"a {what} named {name!r} is registered already")
    registry[name] = part


def register_strategy(name: str, part: type | str) -> None:
    """Make ``--strategy name`` train with ``part`` (a Strategy class or its "module:Class" path)."""
    _register(STRATEGIES, "strategy", name, part)


def register_aggregation(name: str, part: type | str) -> None:
    """Make ``--aggregation name`` combine all-reduce parts with ``part`` (an Aggregation class, or its
    path)."""
    _register(AGGREGATIONS, "aggregation", name, part)


def _load(registry: dict[str, type | str], what: str, name: str) -> type:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(registry)}")
    part = registry[name]
    if isinstance(part, str):
        module, _, attribute = part.partition(":")
        part = registry[name] = getattr(importlib.import_module(module), attribute)
    return part


def strategy_class(name: str) -> type:
    return _load(STRATEGIES, "strategy", name)


def aggregation_class(name: str) -> type:
    return _load(AGGREGATIONS, "aggregation", name)
