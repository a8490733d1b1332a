"""Typed run and peer configuration, by component.

- ``run``: RunConfig, the swarm-wide settings every peer must agree on (model, tokenizer, objective, target
  batch, optimizer and schedule);
- the per-peer components ``network``, ``data``, ``trainer``, ``averaging``, ``monitor``, ``evaluation`` and
  ``general``, merged into one PeerConfig (``config.peer.X``);
- ``data.PrepareConfig`` and ``demo.DemoConfig``: `cotrain prepare`'s and `cotrain demo`'s own options;
- ``fields``: the metadata each field carries (doc line, CLI spellings, roles, the original flag), from which
  the CLI options, their ``--help``, TOML validation and the README's flag table are made;
- ``resolve``: defaults < preset < ``--config FILE.toml`` < command line, and resolved configs as files.

Each component validates its own fields (``problems()``); resolution collects every problem into one
ConfigError.
"""

from cotrain.config.averaging import AveragingConfig
from cotrain.config.data import DataConfig, PrepareConfig
from cotrain.config.demo import DemoConfig
from cotrain.config.evaluation import EvaluationConfig
from cotrain.config.fields import (
    AUTO,
    ROLES_ALL,
    ConfigError,
    cli_flags,
    field_type,
    micro_batch_arg,
    opt,
    seed_flags,
)
from cotrain.config.general import GeneralConfig
from cotrain.config.modelfile import NOT_ARCHITECTURE, model_config_overrides
from cotrain.config.monitor import MonitorConfig
from cotrain.config.network import NetworkConfig
from cotrain.config.peer import PEER_COMPONENTS, PeerConfig, component_of
from cotrain.config.resolve import (
    SECTIONS,
    Config,
    component_for,
    config_from_dict,
    config_hash,
    fields_for,
    load_preset,
    load_resolved,
    load_toml,
    preset_names,
    resolve,
    resolved_json,
    to_toml,
    toml_tables,
    validate,
    write_atomic,
    write_toml,
)
from cotrain.config.run import MOVED_TO_PEER, RunConfig
from cotrain.config.trainer import TrainerConfig

__all__ = [
    "AUTO",
    "MOVED_TO_PEER",
    "NOT_ARCHITECTURE",
    "PEER_COMPONENTS",
    "ROLES_ALL",
    "SECTIONS",
    "AveragingConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DemoConfig",
    "EvaluationConfig",
    "GeneralConfig",
    "MonitorConfig",
    "NetworkConfig",
    "PeerConfig",
    "PrepareConfig",
    "RunConfig",
    "TrainerConfig",
    "cli_flags",
    "component_for",
    "component_of",
    "config_hash",
    "field_type",
    "fields_for",
    "load_preset",
    "config_from_dict",
    "load_resolved",
    "load_toml",
    "micro_batch_arg",
    "model_config_overrides",
    "opt",
    "preset_names",
    "resolve",
    "resolved_json",
    "seed_flags",
    "to_toml",
    "toml_tables",
    "validate",
    "write_atomic",
    "write_toml",
]
