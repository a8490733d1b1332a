"""Typed run and peer configuration.

Each field's metadata (its one-line doc, its command-line spellings and the roles that take it) is the single
source from which the CLI options, their ``--help`` text, TOML validation and the README's flag table are
made.

Precedence: command line > ``--config FILE.toml`` > preset > dataclass defaults.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from cotrain.errors import UserError

ROLES_ALL = ("train", "monitor", "demo", "status", "eval")


class ConfigError(UserError):
    """A user-caused configuration problem; the message lists every problem found."""


def opt(
    default: Any,
    doc: str,
    *,
    flags: tuple[str, ...] = (),
    roles: tuple[str, ...] = ROLES_ALL,
    seed: str = "",
    **kw: Any,
):
    """A dataclass field carrying its doc line, extra CLI spellings, the roles that accept it and, when the
    original recipe had it, the original flag's spelling (``seed``)."""
    meta = {"doc": doc, "flags": flags, "roles": roles, "seed": seed}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class RunConfig:
    """Swarm-wide settings: every peer of a run must agree on them."""

    run_id: str = opt(
        "cotrain",
        "Name of the training run; peers with the same run id train together (no dots).",
        flags=("--experiment-prefix",),
        seed="--experiment_prefix",
    )
    preset: str = opt(
        "albert-large-v2",
        "Name of the shipped preset this config starts from.",
        roles=ROLES_ALL + ("prepare",),
    )
    model_family: str = opt("albert", "Model family: albert (sentence order + masked LM).", roles=())
    objective: str = opt("sop+mlm", "Training objective the dataset was prepared for.", roles=())
    model: dict = opt(
        {}, "Model architecture ([model] table: hidden_size, num_attention_heads, ...).", roles=()
    )
    max_seq_length: int = opt(
        512,
        "Sequence length of the training examples (tokens).",
        flags=("--seq-length",),
        roles=ROLES_ALL + ("prepare",),
        seed="--seq_length",
    )
    mlm_probability: float = opt(0.15, "Fraction of tokens masked for the masked-LM objective.")
    target_batch_size: int = opt(
        4096,
        "Samples the whole swarm accumulates before each global optimizer step.",
        seed="--target_batch_size",
    )
    optimizer: str = opt("lamb", "Optimizer: lamb (the seed recipe) or adamw.")
    learning_rate: float = opt(0.00176, "Peak learning rate.", seed="--learning_rate")
    adam_beta1: float = opt(0.9, "First-moment decay of LAMB/Adam.", seed="--adam_beta1")
    adam_beta2: float = opt(0.999, "Second-moment decay of LAMB/Adam.", seed="--adam_beta2")
    adam_epsilon: float = opt(1e-6, "Epsilon of LAMB/Adam.", seed="--adam_epsilon")
    weight_decay: float = opt(
        0.01, "Weight decay (none on biases and LayerNorm weights).", seed="--weight_decay"
    )
    clamp_value: float = opt(10000.0, "LAMB's clamp on the weight norm.", seed="--clamp_value")
    max_grad_norm: float = opt(
        1.0, "Clip each micro-batch's gradient norm to this value (0 disables).", seed="--max_grad_norm"
    )
    warmup_steps: int = opt(5000, "Global steps of linear learning-rate warmup.", seed="--warmup_steps")
    total_steps: int = opt(
        125000, "Global steps of the whole schedule (linear decay to zero).", seed="--total_steps"
    )
    matchmaking_time: float = opt(
        5.0,
        "Seconds a peer waits for others to form an averaging group.",
        flags=("--averaging-expiration",),
        seed="--averaging_expiration",
    )
    averaging_timeout: float = opt(
        60.0, "Seconds before an averaging round is given up.", seed="--averaging_timeout"
    )
    grad_compression: str = opt("fp16", "Compression of gradients and parameters on the wire: fp16 or none.")


@dataclass
class PeerConfig:
    """Per-peer settings: each peer chooses its own."""

    initial_peers: list = opt(
        [],
        "Multiaddrs of peers already in the swarm (a monitor or any trainer); several for redundancy.",
        roles=("train", "monitor", "status", "eval"),
        seed="--initial_peers",
    )
    host_maddrs: list = opt(
        ["/ip4/0.0.0.0/tcp/0"],
        "Multiaddrs to listen on (default: all interfaces, a free port).",
        roles=("train", "monitor", "status", "eval"),
        seed="--host_maddrs",
    )
    announce_maddrs: list = opt(
        [],
        "Multiaddrs other peers should use to reach this one (e.g. a public IP or /dns4/ name).",
        roles=("train", "monitor", "eval"),
        seed="--announce_maddrs",
    )
    identity_path: str = opt(
        "",
        "File holding this peer's private key: the same file gives the same peer id across restarts.",
        roles=("train", "monitor", "eval"),
        seed="--identity_path",
    )
    client_mode: bool = opt(
        False,
        "Do not accept incoming connections (behind NAT/firewall): train and average through other peers.",
        roles=("train", "eval"),
        seed="--client_mode",
    )
    use_ipfs: bool = opt(
        False, "Bootstrap through the public IPFS network.", roles=("train", "monitor"), seed="--use_ipfs"
    )
    nat_port_map: bool = opt(
        False,
        "Ask the router for a port mapping (UPnP/NAT-PMP); off unless asked.",
        roles=("train", "monitor"),
    )
    dataset_path: str = opt(
        "",
        "Folder made by `cotrain prepare` (the monitor reads only its manifest and tokenizer).",
        roles=("train", "eval", "monitor"),
        seed="--dataset_path",
    )
    dataset_url: str = opt(
        "",
        "URL of a folder made by `cotrain prepare` on any HTTP(S) server; shards download as training goes.",
        roles=("train", "eval", "monitor"),
    )
    cache_dir: str = opt(
        "",
        "Where shards fetched from --dataset-url are cached (default: ~/.cache/cotrain/datasets).",
        roles=("train", "eval", "monitor"),
    )
    tokenizer_path: str = opt(
        "",
        "Tokenizer folder (save_pretrained) for the model's shapes, instead of --dataset-path/--dataset-url.",
        roles=("monitor",),
    )
    output_dir: str = opt(
        "outputs", "Folder for this peer's logs, metrics and checkpoints.", seed="--output_dir"
    )
    per_device_train_batch_size: int = opt(
        4,
        "Samples per micro-batch on this peer.",
        roles=("train", "demo"),
        seed="--per_device_train_batch_size",
    )
    gradient_accumulation_steps: int = opt(
        1,
        "Micro-batches accumulated per optimizer.step call.",
        roles=("train", "demo"),
        seed="--gradient_accumulation_steps",
    )
    max_steps: int = opt(
        0, "Stop after this many global steps of the swarm (0: never).", roles=("train",), seed="--max_steps"
    )
    seed: int = opt(
        0,
        "Seed of this peer's data order and masking (each peer should use its own).",
        roles=ROLES_ALL + ("prepare",),
        seed="--seed",
    )
    torch_threads: int = opt(0, "CPU threads for torch on this peer (0: torch's default).")
    batch_size_lead: int = opt(
        0,
        "Start averaging this many samples before the target batch is reached.",
        roles=("train",),
        seed="--batch_size_lead",
    )
    bandwidth: float = opt(
        0.0,
        "This peer's network bandwidth in Mbit/s, to balance all-reduce load (0: unknown).",
        roles=("train",),
        seed="--bandwidth",
    )
    statistics_expiration: float = opt(
        600.0,
        "Seconds a published metrics record stays valid in the DHT.",
        roles=("train", "eval"),
        seed="--statistics_expiration",
    )
    load_state_timeout: float = opt(
        60.0,
        "Seconds to wait for the current model state from other peers (joining; a monitor's checkpoint).",
        roles=("train", "monitor"),
    )
    save_every: int = opt(
        500,
        "Global steps between the monitor's checkpoints of the swarm's state (0: none).",
        flags=("--save-checkpoint-step-interval",),
        roles=("monitor",),
        seed="--save_checkpoint_step_interval",
    )
    keep_checkpoints: int = opt(3, "Checkpoints the monitor keeps (the newest ones).", roles=("monitor",))
    resume: bool = opt(
        False,
        "Start from the newest good checkpoint in OUTPUT_DIR/checkpoints and serve it to peers.",
        roles=("monitor",),
    )
    push_to_hub: str = opt(
        "",
        "Hugging Face Hub repository (user/name) to upload the newest checkpoint to, as a model folder.",
        flags=("--repo-url", "--repo-path"),
        roles=("monitor",),
        seed="--repo_url",
    )
    upload_every: float = opt(
        3600.0,
        "Seconds between uploads to --push-to-hub.",
        flags=("--upload-interval",),
        roles=("monitor",),
        seed="--upload_interval",
    )
    save_steps: int = opt(
        500,
        "Global steps between this trainer's local checkpoints in OUTPUT_DIR/checkpoints (0: none).",
        roles=("train",),
        seed="--save_steps",
    )
    save_total_limit: int = opt(
        2, "Local checkpoints a trainer keeps (the newest ones).", roles=("train",), seed="--save_total_limit"
    )
    overwrite_output_dir: bool = opt(
        False,
        "Do not resume from the checkpoints in OUTPUT_DIR/checkpoints (start from the swarm or afresh).",
        roles=("train",),
        seed="--overwrite_output_dir",
    )
    resume_from: str = opt(
        "", "Resume this trainer from this checkpoint folder, then catch up with the swarm.", roles=("train",)
    )
    refresh_period: float = opt(
        30.0,
        "Seconds between the monitor's reads of the swarm's metrics.",
        roles=("monitor", "status"),
        seed="--refresh_period",
    )
    startup_timeout: float = opt(
        20.0,
        "Seconds to wait for the network layer to start and reach initial peers.",
        roles=("train", "monitor", "status"),
    )
    verbose: bool = opt(False, "Log hivemind's status lines at INFO instead of DEBUG.")
    dashboard_port: int = opt(
        8080,
        "Port of the monitor's live web dashboard (0: any free port; -1: no dashboard).",
        roles=("monitor", "demo"),
    )
    dashboard_host: str = opt(
        "127.0.0.1",
        "Address the dashboard listens on (0.0.0.0 exposes it to other machines).",
        roles=("monitor", "demo"),
    )
    tensorboard_dir: str = opt(
        "", "Also write the swarm's metrics as TensorBoard event files to this folder.", roles=("monitor",)
    )
    wandb_project: str = opt(
        "",
        "Also log the swarm's metrics to this Weights & Biases project (WANDB_MODE=offline works).",
        roles=("monitor",),
        seed="--wandb_project",
    )
    json: bool = opt(False, "Print the swarm's state as one JSON object.", roles=("status",))


@dataclass
class PrepareConfig:
    """Options of `cotrain prepare` (turning a corpus into training examples)."""

    demo_corpus: bool = opt(
        False, "Use the built-in demo corpus (text that ships with Python).", roles=("prepare",)
    )
    text_files: list = opt(
        [], "Local text files or globs (WikiText format is recognised).", roles=("prepare",)
    )
    output: str = opt("data", "Folder to write the prepared dataset to.", roles=("prepare",))
    tokenizer: str = opt(
        "", "Pretrained tokenizer folder; a new one is trained when empty.", roles=("prepare",)
    )
    vocab_size: int = opt(8000, "Vocabulary size of a tokenizer trained here.", roles=("prepare", "demo"))
    valid_fraction: float = opt(0.02, "Fraction of documents held out for evaluation.", roles=("prepare",))
    objective: str = opt(
        "", "Examples to make: sop+mlm, mlm or clm (default: the preset's objective).", roles=("prepare",)
    )
    tokenizer_type: str = opt(
        "",
        "Tokenizer to train: unigram (ALBERT), wordpiece (BERT) or bpe (RoBERTa, GPT-2); "
        "default: the objective's.",
        roles=("prepare",),
    )
    train_tokenizer: bool = opt(
        False, "Train a tokenizer on the corpus (the default without --tokenizer).", roles=("prepare",)
    )
    dataset: str = opt(
        "",
        "Hugging Face dataset name (needs a network) or a local folder of parquet/json/text files.",
        roles=("prepare",),
    )
    dataset_config: str = opt("", "Configuration of --dataset (e.g. wikitext-103-v1).", roles=("prepare",))
    dataset_split: str = opt("train", "Split of --dataset to read.", roles=("prepare",))
    recipe_data: str = opt(
        "",
        "Data tokenized by the original recipe: a save_to_disk folder or .tar/.tar.gz, a path or a URL.",
        roles=("prepare",),
    )
    shard_size: int = opt(10000, "Examples per shard of the prepared dataset.", roles=("prepare",))
    num_proc: int = opt(1, "Worker processes that make examples.", roles=("prepare",))


@dataclass
class DemoConfig:
    """Options of `cotrain demo` (a whole swarm on this machine)."""

    peers: int = opt(2, "Number of trainer peers to start.", roles=("demo",))
    steps: int = opt(8, "Global steps to train before stopping.", roles=("demo",))
    deadline: float = opt(
        540.0, "Seconds after which the demo stops even if the steps are not done.", roles=("demo",)
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "peer": PeerConfig,
    "prepare": PrepareConfig,
    "demo": DemoConfig,
}


def field_type(f: dataclasses.Field) -> type:
    """The runtime type of a field (annotations are strings here)."""
    hints: dict = {}
    for cls in SECTIONS.values():
        hints |= typing.get_type_hints(cls)
    t = hints[f.name]
    if isinstance(t, types.UnionType):
        t = next(a for a in t.__args__ if a is not type(None))
    return typing.get_origin(t) or t


def fields_for(role: str) -> list[tuple[str, dataclasses.Field]]:
    """(section, field) pairs that a role's command line takes, in declaration order."""
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if role in f.metadata["roles"]:
                out.append((section, f))
    return out


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


def _coerce(name: str, value: Any, f: dataclasses.Field, problems: list[str]) -> Any:
    t = field_type(f)
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is list and isinstance(value, str):
        return [value]
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        problems.append(f"{name}: expected {t.__name__}, got {type(value).__name__} {value!r}")
        return None
    return value


def _apply(values: dict, layer: dict, origin: str, problems: list[str]) -> None:
    """Validate one layer (a preset, a file or the command line) and merge it into ``values``."""
    for section, table in layer.items():
        cls = SECTIONS.get(section)
        if cls is None or not isinstance(table, dict):
            problems.append(f"{origin}: unknown section [{section}] (expected one of {', '.join(SECTIONS)})")
            continue
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in table.items():
            f = by_name.get(key)
            if f is None:
                problems.append(f"{origin}: unknown key {section}.{key}")
                continue
            coerced = _coerce(f"{origin}: {section}.{key}", value, f, problems)
            if coerced is not None:
                if isinstance(coerced, dict) and isinstance(values[section].get(key), dict):
                    coerced = {**values[section][key], **coerced}
                values[section][key] = coerced


def validate(config: Config) -> list[str]:
    """Every semantic problem of a resolved config, each as one line."""
    run, peer = config.run, config.peer
    problems = []
    if not run.run_id or "." in run.run_id or "/" in run.run_id:
        problems.append(f"run_id {run.run_id!r} must be non-empty and contain no '.' or '/'")
    for name in ("target_batch_size", "max_seq_length", "total_steps"):
        if getattr(run, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(run, name)}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        if getattr(peer, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(peer, name)}")
    if run.warmup_steps < 0 or run.warmup_steps > run.total_steps:
        problems.append(
            f"warmup_steps must be between 0 and total_steps ({run.total_steps}), got {run.warmup_steps}"
        )
    if run.learning_rate <= 0:
        problems.append(f"learning_rate must be positive, got {run.learning_rate}")
    if not 0 < run.mlm_probability < 1:
        problems.append(f"mlm_probability must be between 0 and 1, got {run.mlm_probability}")
    if run.optimizer not in ("lamb", "adamw"):
        problems.append(f"optimizer must be lamb or adamw, got {run.optimizer!r}")
    if run.grad_compression not in ("fp16", "none"):
        problems.append(f"grad_compression must be fp16 or none, got {run.grad_compression!r}")
    if run.matchmaking_time <= 0 or run.averaging_timeout <= 0:
        problems.append("matchmaking_time and averaging_timeout must be positive")
    micro = peer.per_device_train_batch_size * peer.gradient_accumulation_steps
    if run.target_batch_size < micro:
        problems.append(
            f"target_batch_size ({run.target_batch_size}) is smaller than one step of this peer "
            f"(per_device_train_batch_size x gradient_accumulation_steps = {micro})"
        )
    if peer.max_steps < 0 or peer.torch_threads < 0 or peer.batch_size_lead < 0:
        problems.append("max_steps, torch_threads and batch_size_lead must not be negative")
    if config.demo.peers < 1 or config.demo.steps < 1:
        problems.append("demo peers and steps must be at least 1")
    if not 0 <= config.prepare.valid_fraction < 1 or config.prepare.vocab_size < 100:
        problems.append("valid_fraction must be in [0, 1) and vocab_size at least 100")
    if peer.refresh_period <= 0 or peer.statistics_expiration <= 0 or peer.load_state_timeout <= 0:
        problems.append("refresh_period, statistics_expiration and load_state_timeout must be positive")
    if peer.save_every < 0 or peer.save_steps < 0 or peer.upload_every <= 0:
        problems.append("save_every and save_steps must not be negative, upload_every must be positive")
    if peer.keep_checkpoints < 1 or peer.save_total_limit < 1:
        problems.append("keep_checkpoints and save_total_limit must be at least 1")
    if not -1 <= peer.dashboard_port <= 65535:
        problems.append(f"dashboard_port must be -1 (off), 0 (a free port) or a port: {peer.dashboard_port}")
    return problems


def resolve(
    preset: str | None = None, config_file: str | None = None, overrides: dict | None = None
) -> Config:
    """Build a config from defaults < preset < TOML file < command-line overrides.

    Raises ConfigError listing every problem found."""
    values: dict[str, dict] = {
        section: {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
        for section, cls in SECTIONS.items()
    }
    problems: list[str] = []
    overrides = overrides or {}
    file_layer = load_toml(config_file) if config_file else {}
    name = overrides.get("run", {}).get("preset") or preset or file_layer.get("run", {}).get("preset")
    name = name or values["run"]["preset"]
    _apply(values, load_preset(name), f"preset {name}", problems)
    values["run"]["preset"] = name
    if file_layer:
        _apply(values, file_layer, str(config_file), problems)
    _apply(values, overrides, "command line", problems)
    if problems:
        raise ConfigError("; ".join(problems))
    config = Config(**{section: cls(**values[section]) for section, cls in SECTIONS.items()})
    problems = validate(config)
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def config_hash(run: RunConfig) -> str:
    """A short hash of the swarm-wide settings that every peer must agree on."""
    import hashlib

    payload = json.dumps(dataclasses.asdict(run), sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
