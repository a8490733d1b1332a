"""The parameters a part declares (an aggregation's, a codec's: cotrain.registry) and how the values a run's
config gives them are checked and settled.

A ``Parameter`` holds its default (whose type a given value must have: an int where a float is wanted is
taken), a one-line doc and, optionally, a ``check`` that says what is wrong with a value. A parameter with a
``field`` is set by that config field, with a flag of its own (centered-clip's ``tau`` by ``--clip-tau``,
topk's ``density`` by ``--topk-density``); every other one is set through the part's options
(``--aggregation-option NAME=VALUE``, ``--grad-compression-option``, ``--outer-compression-option``), so
that each parameter has one spelling and peers that agree on a value agree on their config's hash.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Parameter", "option_problems", "parse_assignment", "settle"]


@dataclass(frozen=True)
class Parameter:
    """One parameter of a part: its ``default``, a ``doc`` line, the config ``field`` that sets it ("": the
    part's options do) and a ``check`` returning what is wrong with a value ("" when nothing is)."""

    default: Any
    doc: str = ""
    field: str = ""
    check: Callable[[Any], str] | None = None

    def problem(self, value: Any) -> str:
        """What is wrong with ``value`` ("" when nothing is): its type, then the parameter's own check."""
        expected = type(self.default)
        if self.default is not None:
            number = expected is float and isinstance(value, int) and not isinstance(value, bool)
            if not number and (
                not isinstance(value, expected) or (expected is int and isinstance(value, bool))
            ):
                return f"expected {expected.__name__}, got {type(value).__name__} {value!r}"
        return self.check(value) if self.check is not None else ""


def option_problems(what: str, parameters: Mapping[str, Parameter], given: Any) -> list[str]:
    """Every problem of the options ``given`` to the part ``what`` (e.g. "aggregation trimmed-mean"), one line
    each: options that are not a table, names it does not declare or that a field of their own sets, values
    of the wrong type or that the parameter's check refuses."""
    if not isinstance(given, Mapping):
        return [f"the options of {what} must be a table of NAME = VALUE, got {given!r}"]
    options = sorted(name for name, p in parameters.items() if not p.field)
    flags = [f"--{p.field.replace('_', '-')}" for p in parameters.values() if p.field]
    problems = []
    for name, value in given.items():
        parameter = parameters.get(name)
        if parameter is None:
            known = f"its options: {', '.join(options)}" if options else "it takes no options"
            if flags and not options:
                known += f"; its parameters have flags of their own: {', '.join(flags)}"
            problems.append(f"{what} has no parameter {name!r} ({known})")
        elif parameter.field:
            problems.append(
                f"{what}'s {name} is set by {parameter.field} (--{parameter.field.replace('_', '-')})"
            )
        elif problem := parameter.problem(value):
            problems.append(f"{what}'s {name}: {problem}")
    return problems


def settle(what: str, parameters: Mapping[str, Parameter], given: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the part's options: the ``given`` ones over the defaults (floats where a float is
    declared). Raises ValueError naming every problem."""
    problems = option_problems(what, parameters, given)
    if problems:
        raise ValueError("; ".join(problems))
    values = {name: p.default for name, p in parameters.items() if not p.field}
    for name, value in given.items():
        values[name] = float(value) if isinstance(parameters[name].default, float) else value
    return values


def parse_assignment(text: str) -> dict[str, Any]:
    """``NAME=VALUE`` (a command line's option of a part) as ``{NAME: VALUE}``, the value read as TOML reads
    it (``0.25`` a float, ``3`` an int, ``true`` a bool) or else as the text itself."""
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name:
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    try:
        return {name: tomllib.loads(f"v = {value}")["v"]}
    except tomllib.TOMLDecodeError:
        return {name: value}
