"""The field machinery: a config field carries its one-line doc, its command-line spellings, the roles that
take it and, where the original recipe had it, the original flag. The CLI, its help, TOML validation and the
README's flag table are all made from this metadata.

Component modules do not use ``from __future__ import annotations``: a field's ``type`` is then the real
class (``int``, ``list`` ...), which the CLI and TOML coercion read directly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any

from cotrain.errors import UserError

ROLES_ALL = ("train", "monitor", "demo", "status", "eval")
AUTO = -1  # how an ``auto`` value (e.g. --per-device-train-batch-size auto) is stored


class ConfigError(UserError):
    """A user-caused configuration problem; the message lists every problem found."""


def opt(
    default: Any,
    doc: str,
    *,
    flags: tuple[str, ...] = (),
    roles: tuple[str, ...] = ROLES_ALL,
    seed: str | tuple[str, ...] = "",
    auto: bool = False,
    **kw: Any,
):
    """A dataclass field carrying its doc line, extra CLI spellings, the roles that accept it and, when the
    original recipe had it, the original flag's spelling (``seed``: one, or a tuple when the original
    scripts spelled it several ways). ``auto``: an int field that also takes the word ``auto`` (stored as
    AUTO)."""
    meta = {"doc": doc, "flags": flags, "roles": roles, "seed": seed, "auto": auto}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def default_of(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def field_type(f: dataclasses.Field) -> type:
    """The runtime type of a field: int, float, bool, str, list or dict."""
    t = f.type
    if isinstance(t, str):  # a component written with postponed annotations
        t = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "dict": dict}[t]
    return t


def micro_batch_arg(value: int) -> str:
    """--per-device-train-batch-size as typed on a command line (``auto`` for AUTO)."""
    return "auto" if value == AUTO else str(value)


def seed_flags(f: dataclasses.Field) -> tuple[str, ...]:
    """The original scripts' spellings of a field (none when the original recipe did not have it)."""
    seed = f.metadata["seed"]
    return (seed,) if isinstance(seed, str) and seed else tuple(seed or ())


def cli_flags(f: dataclasses.Field) -> list[str]:
    """Every spelling of a field on the command line: --kebab-case, the seed's --snake_case, and aliases."""
    main = "--" + f.name.replace("_", "-")
    spellings = [main, "--" + f.name]
    for alias in f.metadata["flags"]:
        spellings += [alias, alias.replace("-", "_").replace("__", "--", 1)]
    seen: list[str] = []
    for s in spellings:
        if s not in seen:
            seen.append(s)
    return seen


def coerce(name: str, value: Any, f: dataclasses.Field, problems: list[str]) -> Any:
    """``value`` as the field's type (an int where a float is wanted, a lone string where a list is, the word
    auto), or None with a problem appended."""
    t = field_type(f)
    if f.metadata.get("auto") and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is list and isinstance(value, str):
        return [value]
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        problems.append(f"{name}: expected {t.__name__}, got {type(value).__name__} {value!r}")
        return None
    return value


def finite_problems(component: Any) -> list[str]:
    """A float field that is NaN or infinite, one line each."""
    return [
        f"{f.name} must be a finite number, got {getattr(component, f.name)}"
        for f in dataclasses.fields(component)
        if isinstance(getattr(component, f.name), float) and not math.isfinite(getattr(component, f.name))
    ]


def negative(component: Any, *names: str) -> list[str]:
    """``NAME must not be negative`` for each of ``names`` below zero."""
    return [
        f"{name} must not be negative, got {getattr(component, name)}"
        for name in names
        if getattr(component, name) < 0
    ]


def not_positive(component: Any, *names: str) -> list[str]:
    """``NAME must be positive`` for each of ``names`` at or below zero."""
    return [
        f"{name} must be positive, got {getattr(component, name)}"
        for name in names
        if getattr(component, name) <= 0
    ]
