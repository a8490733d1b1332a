"""Typed run and peer configuration.

Each field's metadata (its one-line doc, its command-line spellings and the roles that take it) is the single
source from which the CLI options, their ``--help`` text, TOML validation and the README's flag table are
made.

Precedence: command line > ``--config FILE.toml`` > preset > dataclass defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from cotrain.errors import UserError
from cotrain.families import family_problems

ROLES_ALL = ("train", "monitor", "demo", "status", "eval")
AUTO = -1  # how an ``auto`` value (e.g. --per-device-train-batch-size auto) is stored


def micro_batch_arg(value: int) -> str:
    """--per-device-train-batch-size as typed on a command line (``auto`` for AUTO)."""
    return "auto" if value == AUTO else str(value)


def seed_flags(f: dataclasses.Field) -> tuple[str, ...]:
    """The original scripts' spellings of a field (none when the original recipe did not have it)."""
    seed = f.metadata["seed"]
    return (seed,) if isinstance(seed, str) and seed else tuple(seed or ())


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


@dataclass
class RunConfig:
    """Swarm-wide settings: every peer of a run must agree on them."""

    run_id: str = opt(
        "cotrain",
        "Name of the training run; peers with the same run id train together (no dots).",
        flags=("--experiment-prefix",),
        seed=("--experiment_prefix", "--run_id"),
    )
    preset: str = opt(
        "albert-large-v2",
        "Name of the shipped preset this config starts from.",
        roles=ROLES_ALL + ("prepare",),
    )
    model_family: str = opt(
        "albert",
        "Model family: albert (sentence order + masked LM), bert, distilbert, roberta (masked LM) or gpt2 "
        "(causal LM).",
        roles=(),
    )
    objective: str = opt(
        "sop+mlm",
        "Training objective, the family's: sop+mlm (albert), mlm (bert, distilbert, roberta) or clm (gpt2); "
        "`cotrain prepare` makes these examples.",
        roles=(),
    )
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
    whole_word_mask: bool = opt(
        False, "Masked LM: mask all the pieces of a word together (whole-word masking)."
    )
    init_from: str = opt(
        "",
        "Start from pretrained weights: a Hugging Face model folder (offline) or a Hub model name (needs a "
        "network); its architecture replaces [run.model]. Give every peer the same value.",
        flags=("--model-name-or-path",),
        seed="--model_name_or_path",
    )
    target_batch_size: int = opt(
        4096,
        "Samples the whole swarm accumulates before each global optimizer step.",
        seed="--target_batch_size",
    )
    optimizer: str = opt("lamb", "Optimizer: lamb (the seed recipe) or adamw.")
    lr_scheduler: str = opt(
        "linear",
        "Learning-rate decay after the linear warmup, stepped once per global step: linear or cosine.",
    )
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
        125000, "Global steps of the whole schedule (decay to zero).", seed="--total_steps"
    )
    matchmaking_time: float = opt(
        5.0,
        "Seconds a peer waits for others to form an averaging group.",
        flags=("--averaging-expiration",),
        seed=("--averaging_expiration", "--matchmaking_time"),
    )
    averaging_timeout: float = opt(
        60.0, "Seconds before an averaging round is given up.", seed="--averaging_timeout"
    )
    grad_compression: str = opt(
        "fp16",
        "Compression of gradients and parameters on the wire: fp16 or none (optimizer statistics and "
        "downloaded state always travel in full precision).",
    )


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
        "Multiaddrs to listen on (default: all interfaces, a free port); the old IP:PORT forms "
        "([::]:1337, 0.0.0.0:*) are translated.",
        flags=("--listen-on", "--dht-listen-on"),
        roles=("train", "monitor", "status", "eval"),
        seed=("--host_maddrs", "--listen_on", "--dht_listen_on"),
    )
    announce_maddrs: list = opt(
        [],
        "Multiaddrs other peers should use to reach this one (e.g. a public IP or /dns4/ name).",
        roles=("train", "monitor", "eval"),
        seed="--announce_maddrs",
    )
    identity_path: str = opt(
        "",
        "File holding this peer's private key (created, owner-only, when missing): the same file gives the "
        "same peer id across restarts.",
        roles=("train", "monitor", "eval"),
        seed="--identity_path",
    )
    access_token: str = opt(
        "",
        "Token file from the operator of a private swarm (`cotrain token issue`); without one, only public "
        "swarms can be joined.",
        roles=("train", "status", "eval"),
    )
    authority_key: str = opt(
        "",
        "Authority key of a private swarm (made by `cotrain token issue`): admit only peers whose access "
        "tokens it signed and that are not revoked.",
        roles=("monitor",),
    )
    client_mode: bool = opt(
        False,
        "Do not accept incoming connections (behind NAT/firewall): train and average through other peers.",
        roles=("train",),
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
        seed="--cache_dir",
    )
    tokenizer_path: str = opt(
        "",
        "Tokenizer folder (save_pretrained): the monitor's model shapes instead of the dataset's; a "
        "trainer checks it is the tokenizer its dataset was prepared with.",
        flags=("--tokenizer",),
        roles=("train", "monitor"),
        seed=("--tokenizer_path", "--tokenizer"),
    )
    model_config_path: str = opt(
        "",
        "Model architecture from a JSON file, a Hugging Face model folder (its config.json) or a URL; it "
        "overrides the preset's [run.model] (give every peer the same).",
        flags=("--config-path",),
        roles=("train", "monitor", "eval"),
        seed=("--model_config_path", "--config_path"),
    )
    output_dir: str = opt(
        "outputs", "Folder for this peer's logs, metrics and checkpoints.", seed="--output_dir"
    )
    per_device_train_batch_size: int = opt(
        4,
        "Samples per micro-batch on each device of this peer, or auto: the largest that fits the GPU's "
        "memory, with gradient accumulation making up the preset's samples per step (on a CPU: 4).",
        roles=("train", "demo"),
        seed="--per_device_train_batch_size",
        auto=True,
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
    devices: str = opt(
        "",
        "Devices this peer trains on: cpu, cuda, cuda:1, a list (cuda:0,cuda:1) or all (every local GPU, "
        "data parallel); default: the first GPU, else the CPU.",
        roles=("train",),
    )
    fp16: bool = opt(
        False,
        "Mixed precision in float16: torch.autocast with loss scaling (each micro-batch's gradients are "
        "unscaled and checked before the swarm sees them).",
        roles=("train",),
        seed="--fp16",
    )
    bf16: bool = opt(
        False,
        "Mixed precision in bfloat16: torch.autocast (no loss scaling).",
        roles=("train",),
        seed="--bf16",
    )
    dataloader_num_workers: int = opt(
        0,
        "Worker processes that load and collate micro-batches from a local --dataset-path "
        "(0: in the training process).",
        roles=("train",),
        seed="--dataloader_num_workers",
    )
    num_train_epochs: float = opt(
        0.0,
        "Stop after this many passes over this peer's training examples (0: no limit).",
        roles=("train",),
        seed="--num_train_epochs",
    )
    logging_dir: str = opt(
        "",
        "Folder for TensorBoard event files of this trainer's logged steps (needs tensorboard; none when "
        "empty).",
        roles=("train",),
        seed="--logging_dir",
    )
    logging_steps: int = opt(
        1,
        "Log a line (and write --logging-dir) every N global steps; the swarm's record is published every "
        "step.",
        roles=("train",),
        seed="--logging_steps",
    )
    logging_first_step: bool = opt(
        False,
        "Also log the first global step this trainer completes.",
        roles=("train",),
        seed="--logging_first_step",
    )
    backup_every_steps: int = opt(
        10,
        "Keep an in-memory copy of the model and optimizer state every N global steps; when the loss or the "
        "parameters turn NaN/inf, restore it, reload the swarm's state and keep training (0: off).",
        roles=("train",),
        seed="--backup_every_steps",
    )
    target_group_size: int = opt(
        256, "Largest all-reduce group this peer averages in.", roles=("train",), seed="--target_group_size"
    )
    min_refresh_period: float = opt(
        0.5,
        "Fewest seconds between this peer's reads of the swarm's progress.",
        roles=("train",),
        seed="--min_refresh_period",
    )
    max_refresh_period: float = opt(
        0.0,
        "Most seconds between reads of the swarm's progress (0: twice --matchmaking-time, at least 1).",
        roles=("train",),
        seed="--max_refresh_period",
    )
    default_refresh_period: float = opt(
        3.0,
        "Seconds between reads of the swarm's progress while it cannot be estimated.",
        roles=("train",),
        seed="--default_refresh_period",
    )
    expected_drift_peers: float = opt(
        3.0,
        "Peers the progress tracker expects may join per step (it refreshes sooner for them).",
        roles=("train",),
        seed="--expected_drift_peers",
    )
    expected_drift_rate: float = opt(
        0.2,
        "Fraction of the swarm the progress tracker expects may join per step.",
        roles=("train",),
        seed="--expected_drift_rate",
    )
    metadata_expiration: float = opt(
        60.0,
        "Seconds this peer's progress record stays valid in the DHT (the original recipe used 120).",
        roles=("train",),
        seed="--metadata_expiration",
    )
    performance_ema_alpha: float = opt(
        0.1,
        "Smoothing of this peer's samples/s estimate (moving-average weight of the newest step).",
        roles=("train",),
        seed="--performance_ema_alpha",
    )
    offload_optimizer: bool = opt(
        True,
        "Keep the optimizer's parameters and statistics in host memory (--no-offload-optimizer: on the "
        "device).",
        roles=("train",),
    )
    delay_optimizer_step: bool = opt(
        False,
        "Run the optimizer step in the background while the next micro-batches compute (parameters lag one "
        "step).",
        roles=("train",),
    )
    delay_grad_averaging: bool = opt(
        False, "Average gradients in the background too (implies --delay-optimizer-step).", roles=("train",)
    )
    delay_state_averaging: bool = opt(
        True,
        "Average parameters with peers in the background (--no-delay-state-averaging: wait for it).",
        roles=("train",),
    )
    use_relay: bool = opt(
        True,
        "Let libp2p circuit relays carry connections to and from peers behind NAT (--no-use-relay: never).",
        roles=("train", "monitor", "eval"),
    )
    use_auto_relay: bool = opt(
        False,
        "Behind NAT: find relays among the swarm's public peers and become reachable through them.",
        roles=("train", "monitor", "eval"),
    )
    use_google_dns: bool = opt(
        False,
        "Announce the address this machine reaches the internet from (a UDP socket 'connected' to 8.8.8.8 "
        "names it without sending a packet): the public IP of a server or cloud VM.",
        roles=("train", "monitor"),
        seed="--use_google_dns",
    )
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
        roles=("train", "monitor", "eval"),
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
        flags=("--repo-url",),
        roles=("monitor",),
        seed="--repo_url",
    )
    repo_path: str = opt(
        "",
        "Local folder where the model folder uploaded to --push-to-hub is written (default OUTPUT_DIR/hub).",
        roles=("monitor",),
        seed="--repo_path",
    )
    store_checkpoints: bool = opt(
        True,
        "Keep checkpoints of the swarm's state every --save-every steps (--no-store-checkpoints: none).",
        roles=("monitor",),
        seed="--store_checkpoints",
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
        roles=("train", "monitor", "status", "eval"),
    )
    verbose: bool = opt(False, "Log hivemind's status lines at INFO instead of DEBUG.")
    eval_every: float = opt(
        60.0, "Seconds between the evaluation peer's runs on the swarm's latest state.", roles=("eval",)
    )
    eval_batches: int = opt(
        16, "Held-out batches per evaluation: the same batches (and masks) every time.", roles=("eval",)
    )
    per_device_eval_batch_size: int = opt(
        8, "Samples per evaluation batch.", roles=("eval",), seed="--per_device_eval_batch_size"
    )
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
        "Tokenizer to train: unigram (ALBERT), wordpiece (BERT, DistilBERT) or bpe (RoBERTa, GPT-2); "
        "default: the preset's family's (with another --objective, that objective's).",
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


@functools.cache
def _type_hints() -> dict[str, Any]:
    """Every section's field annotations, evaluated once (they are strings here, and evaluating them for
    each of the CLI's few hundred options took seconds)."""
    hints: dict = {}
    for cls in SECTIONS.values():
        hints |= typing.get_type_hints(cls)
    return hints


def field_type(f: dataclasses.Field) -> type:
    """The runtime type of a field (annotations are strings here)."""
    t = _type_hints()[f.name]
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


def _option_problems(peer: PeerConfig) -> list[str]:
    """Problems of the per-peer tuning options (precision, logging, backups, progress tracking)."""
    problems = []
    if peer.fp16 and peer.bf16:
        problems.append("give --fp16 or --bf16, not both")
    if (peer.delay_optimizer_step or peer.delay_grad_averaging) and not peer.offload_optimizer:
        problems.append("delay_optimizer_step and delay_grad_averaging need offload_optimizer")
    for name in ("backup_every_steps", "dataloader_num_workers", "num_train_epochs", "max_refresh_period"):
        if getattr(peer, name) < 0:
            problems.append(f"{name} must not be negative, got {getattr(peer, name)}")
    if peer.logging_steps < 1 or peer.target_group_size < 2:
        problems.append("logging_steps must be at least 1 and target_group_size at least 2")
    for name in ("min_refresh_period", "default_refresh_period", "metadata_expiration"):
        if getattr(peer, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(peer, name)}")
    if 0 < peer.max_refresh_period < peer.min_refresh_period:
        problems.append("max_refresh_period must not be below min_refresh_period")
    if peer.expected_drift_peers < 0 or peer.expected_drift_rate < 0:
        problems.append("expected_drift_peers and expected_drift_rate must not be negative")
    if not 0 < peer.performance_ema_alpha <= 1:
        problems.append(f"performance_ema_alpha must be in (0, 1], got {peer.performance_ema_alpha}")
    return problems


def validate(config: Config) -> list[str]:
    """Every semantic problem of a resolved config, each as one line."""
    run, peer = config.run, config.peer
    problems = [
        f"{f.name} must be a finite number, got {getattr(section, f.name)}"
        for section in (run, peer, config.prepare, config.demo)
        for f in dataclasses.fields(section)
        if isinstance(getattr(section, f.name), float) and not math.isfinite(getattr(section, f.name))
    ]
    if not run.run_id or "." in run.run_id or "/" in run.run_id:
        problems.append(f"run_id {run.run_id!r} must be non-empty and contain no '.' or '/'")
    for name in ("target_batch_size", "max_seq_length", "total_steps"):
        if getattr(run, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(run, name)}")
    if peer.per_device_train_batch_size < 1 and peer.per_device_train_batch_size != AUTO:
        problems.append(
            f"per_device_train_batch_size must be positive or auto, got {peer.per_device_train_batch_size}"
        )
    if peer.gradient_accumulation_steps <= 0:
        problems.append(
            f"gradient_accumulation_steps must be positive, got {peer.gradient_accumulation_steps}"
        )
    problems += _option_problems(peer)
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
    if run.lr_scheduler not in ("linear", "cosine"):
        problems.append(f"lr_scheduler must be linear or cosine, got {run.lr_scheduler!r}")
    problems += family_problems(run.model_family, run.objective)
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
    if peer.eval_every <= 0 or peer.eval_batches < 1 or peer.per_device_eval_batch_size < 1:
        problems.append("eval_every must be positive, eval_batches and per_device_eval_batch_size at least 1")
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
    if values["peer"].get("model_config_path") and not problems:
        architecture = model_config_overrides(
            values["peer"]["model_config_path"], values["run"]["model_family"], problems
        )
        values["run"]["model"] = {**values["run"]["model"], **architecture}
    if problems:
        raise ConfigError("; ".join(problems))
    config = Config(**{section: cls(**values[section]) for section, cls in SECTIONS.items()})
    problems = validate(config)
    if problems:
        raise ConfigError("; ".join(problems))
    return config


# keys of a Hugging Face config.json that are not architecture: the tokenizer gives the vocabulary and
# special ids, the rest is bookkeeping
NOT_ARCHITECTURE = {
    "architectures",
    "model_type",
    "transformers_version",
    "vocab_size",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "id2label",
    "label2id",
}


def model_config_overrides(path: str, family: str, problems: list[str]) -> dict:
    """The architecture in a JSON model config (a file, a Hugging Face model folder's config.json or a
    URL), as [run.model] keys; problems are appended, not raised."""
    try:
        if path.startswith(("http://", "https://")):
            from cotrain.data.fetch import fetch_bytes

            text = fetch_bytes(path).decode()
        else:
            p = Path(path).expanduser()
            text = (p / "config.json" if p.is_dir() else p).read_text()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, UserError) as e:
        problems.append(f"model_config_path {path}: cannot read a JSON model config ({e})")
        return {}
    if not isinstance(data, dict):
        problems.append(f"model_config_path {path}: expected a JSON object")
        return {}
    model_type = data.get("model_type")
    if model_type and model_type.replace("-", "") != family:
        problems.append(
            f"model_config_path {path} is a {model_type!r} config, but the preset trains {family!r}"
        )
        return {}
    return {k: v for k, v in data.items() if k not in NOT_ARCHITECTURE}


def config_hash(run: RunConfig) -> str:
    """A short hash of the swarm-wide settings that every peer must agree on."""
    import hashlib

    payload = json.dumps(dataclasses.asdict(run), sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
