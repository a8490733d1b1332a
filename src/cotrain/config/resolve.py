"""A whole config (run, peer, prepare, demo) and how one is resolved: defaults < preset < TOML file < command
line; and how a resolved config is written to a file and read back (a supervised worker's, a demo peer's,
OUTPUT_DIR/config.toml)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from cotrain.config.data import PrepareConfig
from cotrain.config.demo import DemoConfig
from cotrain.config.fields import AUTO, ConfigError, coerce, finite_problems
from cotrain.config.modelfile import model_config_overrides
from cotrain.config.peer import PeerConfig, component_of
from cotrain.config.run import MOVED_TO_PEER, RunConfig, outer_step_defaults


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    # the RunConfig fields this peer's user chose (by --preset, a --config file or the command line), run_id
    # aside; outside RunConfig, so that it never changes the config's hash
    run_given: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def problems(self) -> list[str]:
        """Every semantic problem, each as one line: each component's, then those across components."""
        problems = self.run.problems() + self.peer.problems()
        for section in (self.prepare, self.demo):
            problems += finite_problems(section) + section.problems()
        peer = self.peer
        micro = peer.per_device_train_batch_size * peer.gradient_accumulation_steps
        if self.run.target_batch_size < micro:
            problems.append(
                f"target_batch_size ({self.run.target_batch_size}) is smaller than one step of this peer "
                f"(per_device_train_batch_size x gradient_accumulation_steps = {micro})"
            )
        if peer.nproc_per_node > 1:
            problems += node_problems(self, peer.nproc_per_node)
        if peer.batch_size_lead and peer.batch_size_lead >= self.run.target_batch_size:
            problems.append(
                f"batch_size_lead ({peer.batch_size_lead}) must be below target_batch_size "
                f"({self.run.target_batch_size}): with such a lead every micro-batch starts a global step"
            )
        return problems


NODE_OPTIMIZERS = ("adamw",)  # elementwise: a step on a shard is the step on the whole parameter


def node_problems(config: Config, world: int) -> list[str]:
    """What a peer of ``world`` ranks (cotrain.engine.node) cannot train with, each as one line."""
    run, peer, problems = config.run, config.peer, []
    if run.strategy != "diloco":
        problems.append(
            f"a peer of {world} ranks trains with --strategy diloco; for sync on several GPUs give "
            "--nproc-per-node 1 (DataParallel over --devices)"
        )
    elif run.optimizer not in NODE_OPTIMIZERS:
        problems.append(
            f"a peer of {world} ranks steps its inner optimizer on shards, which {run.optimizer!r} cannot do "
            f"(LAMB's trust ratio is a norm of each whole parameter): give --optimizer {NODE_OPTIMIZERS[0]}"
        )
    if peer.fp16:
        problems.append(f"a peer of {world} ranks trains in --bf16 or full precision, not --fp16")
    if peer.per_device_train_batch_size == AUTO:
        problems.append(f"a peer of {world} ranks needs --per-device-train-batch-size as a number, not auto")
    return problems


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "peer": PeerConfig,
    "prepare": PrepareConfig,
    "demo": DemoConfig,
}


def component_for(section: str, f: dataclasses.Field) -> type:
    """The component that declares a field: RunConfig, a part of PeerConfig, PrepareConfig or DemoConfig."""
    return component_of(f.name) if section == "peer" else SECTIONS[section]


def fields_for(role: str) -> list[tuple[str, dataclasses.Field]]:
    """(section, field) pairs that a role's command line takes, in declaration order."""
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if role in f.metadata["roles"]:
                out.append((section, f))
    return out


def validate(config: Config) -> list[str]:
    """Every semantic problem of a resolved config, each as one line."""
    return config.problems()


def preset_names() -> list[str]:
    return sorted(
        p.name[: -len(".toml")]
        for p in resources.files("cotrain.presets").iterdir()
        if p.name.endswith(".toml")
    )


def load_preset(name: str) -> dict:
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(names)}")
    text = resources.files("cotrain.presets").joinpath(f"{name}.toml").read_text()
    return tomllib.loads(text)


def load_toml(path: str | Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _apply(values: dict, layer: dict, origin: str, problems: list[str], given: set[str] | None) -> None:
    """Validate one layer (a preset, a file or the command line) and merge it into ``values``; the run
    fields it sets are added to ``given`` (when not None)."""
    for section, table in layer.items():
        cls = SECTIONS.get(section)
        if not isinstance(table, dict):
            problems.append(
                f"{origin}: unknown top-level key {section!r} (settings go in the [run] and [peer] tables; "
                'only preset = "NAME" may stand above them)'
            )
            continue
        if cls is None:
            problems.append(f"{origin}: unknown section [{section}] (expected one of {', '.join(SECTIONS)})")
            continue
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in table.items():
            target = section
            if section == "run" and key in MOVED_TO_PEER:  # a per-peer setting, in an older file's [run]
                target, by_name_here = "peer", {f.name: f for f in dataclasses.fields(PeerConfig)}
            else:
                by_name_here = by_name
            f = by_name_here.get(key)
            if f is None:
                problems.append(f"{origin}: unknown key {section}.{key}")
                continue
            coerced = coerce(f"{origin}: {section}.{key}", value, f, problems)
            if coerced is None:
                continue
            if isinstance(coerced, dict) and isinstance(values[target].get(key), dict):
                coerced = {**values[target][key], **coerced}
            values[target][key] = coerced
            if given is not None and target == "run" and key != "run_id":
                given.add(key)


def _file_preset(layer: dict, origin: str, problems: list[str]) -> str:
    """The preset a config file names (top-level ``preset = "NAME"`` or ``[run] preset``), taken out of the
    layer: the preset is chosen before any layer is applied."""
    names = []
    if "preset" in layer:
        names.append(layer.pop("preset"))
    run = layer.get("run")
    if isinstance(run, dict) and "preset" in run:
        layer["run"] = {k: v for k, v in run.items() if k != "preset"}
        names.append(run["preset"])
    for name in names:
        if not isinstance(name, str):
            problems.append(f"{origin}: preset: expected str, got {type(name).__name__} {name!r}")
            return ""
    if len(set(names)) > 1:
        problems.append(f"{origin} names two presets: {names[0]!r} at the top and {names[1]!r} in [run]")
    return names[0] if names else ""


def _defaults() -> dict[str, dict]:
    return {
        section: {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
        for section, cls in SECTIONS.items()
    }


def resolve(
    preset: str | None = None,
    config_file: str | None = None,
    overrides: dict | None = None,
    default_preset: str | None = None,
) -> Config:
    """Build a config from defaults < preset < TOML file < command-line overrides.

    The preset is the command line's (``overrides["run"]["preset"]`` or ``preset``), else the file's (a
    top-level ``preset = "NAME"`` or ``[run] preset``), else ``default_preset`` or RunConfig's default; its
    [run.model] table, with the keys a file or the command line set on top, is the model. Raises ConfigError
    listing every problem found."""
    values = _defaults()
    problems: list[str] = []
    overrides = overrides or {}
    file_layer = dict(load_toml(config_file)) if config_file else {}
    file_preset = _file_preset(file_layer, str(config_file), problems)
    name = overrides.get("run", {}).get("preset") or preset or file_preset
    given: set[str] = set()
    if name:
        given.add("preset")
    name = name or default_preset or values["run"]["preset"]
    preset_layer = load_preset(name)
    _apply(values, preset_layer, f"preset {name}", problems, given if "preset" in given else None)
    if file_layer:
        _apply(values, file_layer, str(config_file), problems, given)
    _apply(values, overrides, "command line", problems, given)
    values["run"]["preset"] = name
    _strategy_of_preset(values["run"], preset_layer, [file_layer, overrides])
    # the outer step that sparse rounds or a short run choose, unless given (cotrain.config.run)
    values["run"].update({k: v for k, v in outer_step_defaults(values["run"]).items() if k not in given})
    if values["peer"].get("model_config_path") and not problems:
        architecture = model_config_overrides(
            values["peer"]["model_config_path"],
            values["run"]["model_family"],
            problems,
            preset_layer.get("run", {}).get("model", {}),
        )
        values["run"]["model"] = {**values["run"]["model"], **architecture}
        given.add("model")
    return _build(values, sorted(given), problems)


def _strategy_of_preset(run: dict, preset_layer: dict, user_layers: list[dict]) -> None:
    """A preset's sparse rounds (llama-1b) belong to its DiLoCo: a user who chose another strategy, and no
    compression of the rounds, gets dense rounds (which sync ignores), not a refusal of the preset's."""
    preset_run = preset_layer.get("run", {})
    if run.get("strategy") == "diloco" or preset_run.get("outer_compression") != run.get("outer_compression"):
        return
    if not any("outer_compression" in layer.get("run", {}) for layer in user_layers):
        run["outer_compression"] = RunConfig.outer_compression


def _build(values: dict, run_given: list[str], problems: list[str]) -> Config:
    if problems:
        raise ConfigError("; ".join(problems))
    config = Config(
        **{section: cls(**values[section]) for section, cls in SECTIONS.items()}, run_given=run_given
    )
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def config_hash(run: RunConfig) -> str:
    """A short hash of the swarm-wide settings that every peer must agree on."""
    payload = json.dumps(dataclasses.asdict(run), sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


# --- a resolved config as a file ---------------------------------------------------------------------


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename: a reader sees
    the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def resolved_json(config: Config) -> str:
    """The whole resolved config (every section and run_given) as JSON, for load_resolved."""
    return json.dumps(config.to_dict(), indent=1, sort_keys=True) + "\n"


def load_resolved(path: str | Path) -> Config:
    """A config as ``resolved_json`` writes it, from a file or, where ``path`` is ``-``, from standard input
    (how a supervisor hands its worker the config: no file to outlive it), validated again (raises
    ConfigError)."""
    stdin = str(path) == "-"
    origin = "resolved config on standard input" if stdin else f"resolved config {path}"
    try:
        data = json.loads(sys.stdin.read() if stdin else Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{origin} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{origin} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} is not a JSON object")
    return config_from_dict(data, "standard input" if stdin else str(path))


def config_from_dict(data: dict, origin: str = "config") -> Config:
    """A Config from ``Config.to_dict()`` (as resolved_json writes it), checked (raises ConfigError)."""
    data = dict(data)
    run_given = data.pop("run_given", [])
    values, problems = _defaults(), []
    if not isinstance(run_given, list) or not all(isinstance(n, str) for n in run_given):
        problems.append(f"{origin}: run_given must be a list of field names")
    _apply(values, data, origin, problems, None)
    return _build(values, list(run_given), problems)


def _toml_value(value: Any) -> Any:
    """TOML has no null: keys whose value is None are left out (of the model table, where a JSON model
    config may hold them)."""
    if isinstance(value, dict):
        return {k: _toml_value(v) for k, v in value.items() if v is not None}
    return value


def toml_tables(config: Config) -> dict:
    """The [run] and [peer] tables of a config, as a --config file takes them."""
    peer = dataclasses.asdict(config.peer)
    for f in dataclasses.fields(config.peer):
        if f.metadata.get("auto") and peer[f.name] == AUTO:
            peer[f.name] = "auto"
    return {"run": _toml_value(dataclasses.asdict(config.run)), "peer": _toml_value(peer)}


def to_toml(config: Config) -> str:
    import tomli_w

    return tomli_w.dumps(toml_tables(config))


def write_toml(config: Config, path: str | Path) -> Path:
    """The [run] and [peer] tables as a TOML file that `--config` reads back (OUTPUT_DIR/config.toml)."""
    return write_atomic(path, to_toml(config))
