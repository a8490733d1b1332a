"""The registries of the parts a run chooses by name: training strategies (``--strategy``), all-reduce
aggregations (``--aggregation``) and codecs (``--grad-compression``, ``--outer-compression``). The run's
config reads its choices, and the parameters each part declares, here; the engine builds the part a name
stands for. Each entry is a class (a codec: a ``cotrain.algorithms.codecs.Codec``) or the ``"module:Class"``
path of one (imported on first use, so that reading the names imports no torch or hivemind).

A new strategy is a class with the methods of ``cotrain.strategies.base.Strategy`` in a module of its own,
and one line here (or a call of ``register_strategy`` before the run's config is checked, e.g. in a script
of one's own); a new aggregation is a subclass of ``cotrain.algorithms.aggregation.Aggregation`` and one line
(or ``register_aggregation``), its parameters (``cotrain.algorithms.parameters.Parameter``) in the same line;
a new codec is a ``Codec`` (its kind, bytes per value, parameters and the "module:attr" of what it builds) and
one line (or ``register_codec``). A part's parameters take their values from the run's config
(``--aggregation-option NAME=VALUE``, ``--grad-compression-option``, ``--outer-compression-option``),
checked against what the part declares. Every peer of a run must know the part its config names.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from cotrain.algorithms.codecs import Codec
from cotrain.algorithms.parameters import Parameter

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_PARAMETERS",
    "CODECS",
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "aggregation_class",
    "aggregation_parameters",
    "codec",
    "codec_names",
    "register_aggregation",
    "register_codec",
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
# what each aggregation takes: its parameters (those with a field are set by that field's own flag)
AGGREGATION_PARAMETERS: dict[str, Mapping[str, Parameter]] = {
    "mean": {},
    "centered-clip": {
        "tau": Parameter("auto", "the clipping radius on a part's L2 norm, or auto", "clip_tau"),
        "iterations": Parameter(5, "iterations per part", "clip_iterations"),
    },
}
CODECS: dict[str, Codec | str] = {
    "fp16": "cotrain.algorithms.codecs:FP16",
    "8bit": "cotrain.algorithms.codecs:BITS_8",
    "none": "cotrain.algorithms.codecs:NONE",
    "topk": "cotrain.algorithms.codecs:TOPK",
}


def _register(registry: dict, what: str, name: str, part: object) -> None:
    if not name or not isinstance(name, str) or name != name.strip() or "." in name:
        raise ValueError(f"a {what} name must be a non-empty word without dots, got {name!r}")
    if name in registry and registry[name] != part:
        raise ValueError(f"a {what} named {name!r} is registered already")
    registry[name] = part


def register_strategy(name: str, part: type | str) -> None:
    """Make ``--strategy name`` train with ``part`` (a Strategy class or its "module:Class" path)."""
    _register(STRATEGIES, "strategy", name, part)


def register_aggregation(
    name: str, part: type | str, parameters: Mapping[str, Parameter] | None = None
) -> None:
    """Make ``--aggregation name`` combine all-reduce parts with ``part`` (an Aggregation class, or its
    path), which is built with the values of its ``parameters`` (``--aggregation-option NAME=VALUE``)."""
    parameters = dict(parameters or {})
    problems = [
        f"parameter {n!r} is not a Parameter" for n, p in parameters.items() if not isinstance(p, Parameter)
    ]
    if problems:
        raise ValueError(f"aggregation {name!r}: {'; '.join(problems)}")
    if (
        name in AGGREGATIONS
        and AGGREGATIONS[name] == part
        and AGGREGATION_PARAMETERS.get(name, {}) != parameters
    ):
        raise ValueError(f"an aggregation named {name!r} is registered already, with other parameters")
    _register(AGGREGATIONS, "aggregation", name, part)
    AGGREGATION_PARAMETERS[name] = parameters


def register_codec(name: str, part: Codec | str) -> None:
    """Make ``name`` a choice of ``--grad-compression`` (a dense codec) or ``--outer-compression`` (a records
    codec): ``part`` is a ``cotrain.algorithms.codecs.Codec`` or the "module:attr" path of one."""
    if not isinstance(part, Codec | str):
        raise ValueError(f"a codec is a cotrain.algorithms.codecs.Codec or its path, got {part!r}")
    if name == "dense":
        raise ValueError("'dense' names the dense rounds of --outer-compression: choose another codec name")
    _register(CODECS, "codec", name, part)


def _load(registry: dict, what: str, name: str) -> object:
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


def aggregation_parameters(name: str) -> Mapping[str, Parameter]:
    """The parameters the aggregation ``name`` declares (none if it was registered without)."""
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {name!r}; choose one of: {', '.join(AGGREGATIONS)}")
    return AGGREGATION_PARAMETERS.get(name, {})


def codec(name: str) -> Codec:
    """The codec registered as ``name``."""
    part = _load(CODECS, "codec", name)
    if not isinstance(part, Codec):
        raise ValueError(f"codec {name!r} is registered as {part!r}, not a cotrain.algorithms.codecs.Codec")
    return part


def codec_names(kind: str) -> tuple[str, ...]:
    """The names of the codecs of ``kind`` (dense: --grad-compression's choices; records: those of
    --outer-compression besides dense), in their order of registration."""
    return tuple(name for name in CODECS if codec(name).kind == kind)
