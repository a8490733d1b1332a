"""The `cotrain` command: one entry point, each subcommand a plain function.

Options are generated from the config dataclasses' field metadata (cotrain.config), so the help, the TOML keys
and the README's flag table never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from cotrain import config as cfg
from cotrain.algorithms.parameters import parse_assignment
from cotrain.errors import UserError

DESCRIPTIONS = {
    "prepare": "Turn a corpus into training examples (and train a tokenizer when none is given).",
    "train": "Join a swarm as a trainer: compute gradients locally and average them with peers (a trainer "
    "whose run settings differ from the swarm's is refused, naming the differing fields).",
    "monitor": "Start the swarm's first peer: welcome others, aggregate and log the swarm's metrics.",
    "demo": "Run a whole swarm on this machine (a monitor and N trainers on 127.0.0.1) and report.",
    "config": "Show the resolved configuration of a preset, with a TOML file and the run's flags on top.",
    "eval": "Join a swarm as an evaluation peer: load its latest state every --eval-every seconds, publish "
    "held-out loss, perplexity and accuracy.",
    "status": "Show a running swarm's state (step, peers, progress, throughput, ETA, evaluations) and exit.",
    "export": "Turn a checkpoint into a Hugging Face model folder (config, safetensors weights, tokenizer).",
    "token": "Private swarms: issue, revoke and list the access tokens that let participants join.",
}


def _metavar(f: dataclasses.Field) -> str:
    return f.name.upper().split("_")[-1]


class Assignments(argparse.Action):
    """A repeatable ``--NAME-option KEY=VALUE`` flag of a table field: each one adds its key to the table."""

    def __call__(self, parser, namespace, text, option_string=None) -> None:
        try:
            pair = parse_assignment(text)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, {**getattr(namespace, self.dest, {}), **pair})


def int_or_auto(text: str) -> int:
    """A command-line integer that may also be the word ``auto`` (stored as cotrain.config.AUTO)."""
    if text.strip().lower() == "auto":
        return cfg.AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number or auto, got {value}")
    return value


def add_config_options(parser: argparse.ArgumentParser, role: str) -> None:
    """Add every config field that ``role`` takes, with all its spellings and its doc line as help."""
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help='TOML file: preset = "NAME" at the top, then [run] and [peer] tables (the command line wins).',
    )
    groups: dict[type, argparse._ArgumentGroup] = {}
    for section, f in cfg.fields_for(role):  # one group per component, its docstring as the description
        component = cfg.component_for(section, f)
        if component not in groups:
            title = f"{component.TITLE} options ([{section}] in a --config file)"
            groups[component] = parser.add_argument_group(title, component.__doc__)
        group = groups[component]
        t = cfg.field_type(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
        if t is bool:  # on by default: --no-NAME turns it off
            action = argparse.BooleanOptionalAction if default is True else "store_true"
            kwargs.update(action=action, help=f.metadata["doc"])
        elif f.metadata.get("auto"):
            help_text = f"{f.metadata['doc']} (default: {default})"
            kwargs.update(type=int_or_auto, metavar="N|auto", help=help_text)
        elif t is list:
            kwargs.update(nargs="+", action="extend", metavar=_metavar(f), help=f"{f.metadata['doc']}")
        elif t is dict:
            kwargs.update(action=Assignments, metavar="NAME=VALUE", help=f.metadata["doc"])
        else:
            shown = f" (default: {default})" if default not in ("", None) else ""
            kwargs.update(type=t, metavar=_metavar(f), help=f"{f.metadata['doc']}{shown}")
        group.add_argument(*cfg.cli_flags(f), **kwargs)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (a UserError pointing to --help), not the usage text and an exit."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="cotrain",
        description="Train language models collaboratively: volunteers' machines form a swarm with hivemind.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for role in ("prepare", "train", "monitor", "eval", "demo", "status"):
        p = sub.add_parser(role, help=DESCRIPTIONS[role], description=DESCRIPTIONS[role])
        add_config_options(p, role)
    p = sub.add_parser("config", help=DESCRIPTIONS["config"], description=DESCRIPTIONS["config"])
    p.add_argument("action", choices=["show"], help="show: print the resolved config as TOML")
    p.add_argument("preset", help=f"preset name ({', '.join(cfg.preset_names())})")
    add_config_options(p, "train")  # what a `cotrain train` of these settings would run with
    p = sub.add_parser("export", help=DESCRIPTIONS["export"], description=DESCRIPTIONS["export"])
    p.add_argument(
        "checkpoint",
        help="a checkpoint folder (step-NNNNNN) or a checkpoints folder (its newest good checkpoint)",
    )
    p.add_argument(
        "out_dir",
        help="folder to write: the family's Auto class loads it (AutoModelForPreTraining for ALBERT, "
        "AutoModelForMaskedLM for BERT/DistilBERT/RoBERTa, AutoModelForCausalLM for GPT-2, Llama and "
        "Qwen2)",
    )
    add_token_parser(sub)
    return parser


def add_token_parser(sub: argparse._SubParsersAction) -> None:
    """`cotrain token issue/revoke/list`: the operator's side of a private swarm (cotrain.access)."""
    text = f"{DESCRIPTIONS['token']} The monitor runs with --authority-key, the others with --access-token."
    p = sub.add_parser("token", help=DESCRIPTIONS["token"], description=text)
    actions = p.add_subparsers(dest="token_action", metavar="ACTION", required=True)
    key_help = (
        "the swarm's authority key (default: authority.key); the registry of issued tokens is kept next to "
        "it (authority.key: authority.tokens.json)"
    )
    q = actions.add_parser(
        "issue",
        help="sign a token for a participant and write it to a file (creates the authority key if missing)",
        description="Sign an access token for one participant and write it to a file for them.",
    )
    q.add_argument("--name", required=True, help="who the token is for (shown in logs and `token list`)")
    q.add_argument(
        "--valid-days", type=float, default=30.0, metavar="DAYS", help="days until it expires (default: 30)"
    )
    q.add_argument("--output", "-o", metavar="FILE", help="token file to write (default: NAME.token)")
    q.add_argument("--authority-key", default="authority.key", metavar="FILE", help=key_help)
    q = actions.add_parser(
        "revoke",
        help="revoke every token of a participant; the running monitor tells the swarm within seconds",
        description="Revoke every token issued to a participant. A running monitor publishes the revocation "
        "to the swarm; peers refuse the revoked tokens from then on.",
    )
    q.add_argument("--name", required=True, help="whose tokens to revoke")
    q.add_argument("--authority-key", default="authority.key", metavar="FILE", help=key_help)
    q = actions.add_parser("list", help="list the issued tokens", description="List the issued tokens.")
    q.add_argument("--json", action="store_true", help="one JSON object per token")
    q.add_argument("--authority-key", default="authority.key", metavar="FILE", help=key_help)


def overrides_from(ns: argparse.Namespace) -> dict:
    out: dict[str, dict] = {}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            out.setdefault(section, {})[name] = value
    return out


def parse(argv: list[str]) -> tuple[argparse.Namespace, cfg.Config | None]:
    """Parse a command line and resolve its config (raises UserError with every problem listed)."""
    ns = build_parser().parse_args(argv)
    if ns.command == "config":
        overrides = overrides_from(ns)
        named = overrides.setdefault("run", {}).setdefault("preset", ns.preset)
        if named != ns.preset:
            raise UserError(f"two presets named: {ns.preset!r} and --preset {named!r}; name one")
        return ns, cfg.resolve(ns.preset, ns.config, overrides=overrides)
    if ns.command in ("export", "token"):
        return ns, None
    # the demo trains the CPU-sized model unless told otherwise (on the command line or in its --config file)
    default_preset = "albert-tiny" if ns.command == "demo" else None
    return ns, cfg.resolve(config_file=ns.config, overrides=overrides_from(ns), default_preset=default_preset)


def check_local_paths(command: str, config: cfg.Config) -> None:
    """What a role needs on this machine, checked before its processes start: its dataset folder and a
    writable output folder. Only light checks: this process supervises the role for its whole run, so it
    imports neither torch nor hivemind (addresses and a checkpoint to resume from are the worker's to
    check, before it starts the network layer)."""
    peer = config.peer
    if command == "train" and peer.dataset_path and not peer.dataset_url:
        from cotrain.data import read_manifest  # (no dataset at all: reported after an unreachable swarm)

        read_manifest(peer.dataset_path)
    check_writable(Path(peer.output_dir))


def monitor_config(ns: argparse.Namespace, config: cfg.Config) -> cfg.Config:
    """The monitor's config with the preset its dataset or checkpoint was made for, when the user named none
    (a preset the user named that disagrees with them is refused in one line, before anything starts)."""
    from cotrain.preflight import monitor_preset  # deferred: loaded by its subcommand only

    found = monitor_preset(config)
    if found is None:
        return config
    preset, source = found
    print(f"cotrain monitor: running preset {preset}, the one {source} was made for", file=sys.stderr)
    overrides = overrides_from(ns)
    overrides["run"] = {**overrides.get("run", {}), "preset": preset}
    return cfg.resolve(config_file=ns.config, overrides=overrides)


def check_writable(folder: Path, what: str = "the output folder") -> None:
    """Create ``folder`` if needed and write (then remove) a temporary file in it, or raise UserError."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"cannot write to {what} {folder}: {e.strerror or e}") from None


def describe_os_error(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


def fail(command: str, message: str) -> int:
    print(f"cotrain{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    return 2


def cmd_config(config: cfg.Config) -> int:
    print(cfg.to_toml(config), end="")  # [run] and [peer], as a --config file takes them
    return 0


def cmd_prepare(config: cfg.Config) -> int:
    import json

    from cotrain.data import DataError, prepare_from_source  # deferred: loaded by its subcommand only
    from cotrain.families import tokenizer_type_for  # deferred: loaded by its subcommand only

    p = config.prepare
    objective = p.objective or config.run.objective
    if p.train_tokenizer and p.tokenizer:
        raise DataError("give either --tokenizer or --train-tokenizer, not both")
    check_writable(Path(p.output).absolute().parent, "the folder of --output")
    manifest = prepare_from_source(
        demo=p.demo_corpus,
        text_files=p.text_files or None,
        dataset=p.dataset,
        dataset_config=p.dataset_config,
        dataset_split=p.dataset_split,
        recipe_data=p.recipe_data,
        out_dir=p.output,
        max_length=config.run.max_seq_length,
        seed=config.peer.seed,
        tokenizer_path=p.tokenizer or None,
        vocab_size=p.vocab_size,
        valid_fraction=p.valid_fraction,
        objective=objective,
        tokenizer_type=p.tokenizer_type or tokenizer_type_for(config.run.model_family, objective),
        config={"preset": config.run.preset},  # the monitor of a run on this dataset takes its preset
        shard_size=p.shard_size,
        num_proc=p.num_proc,
        progress=True,
    )
    summary = {k: v for k, v in manifest.items() if k not in ("shards", "config", "tokenizer")}
    summary["num_shards"] = {split: len(shards) for split, shards in manifest["shards"].items()}
    print(json.dumps({"event": "prepared", "path": p.output, **summary}))
    return 0


def cmd_status(config: cfg.Config) -> int:
    import json
    import logging

    from cotrain.status import describe, swarm_status  # deferred: loaded by its subcommand only

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("hivemind", "asyncio"):  # a short-lived client: its network chatter is not the answer
        logging.getLogger(name).setLevel(logging.CRITICAL)
    state = swarm_status(config)
    print(json.dumps(state) if config.peer.json else describe(state), flush=True)
    return 0


def cmd_export(checkpoint: str, out_dir: str) -> int:
    import json
    import logging

    from cotrain.checkpoints import export  # deferred: loaded by its subcommand only

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = export(checkpoint, out_dir)
    print(json.dumps({"event": "exported", "checkpoint": checkpoint, "path": str(out)}))
    return 0


def cmd_token(ns: argparse.Namespace) -> int:
    import json
    import logging

    from cotrain import access  # deferred: loaded by its subcommand only

    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # a skipped registry entry, say
    key = ns.authority_key
    if ns.token_action == "issue":
        issued = access.issue_token(key, ns.name, ns.valid_days, ns.output)
        if issued.created_authority:
            print(f"created authority key {key} (keep it secret; the monitor runs with it)")
        token, out = issued.token, issued.path
        print(f"issued token {token.fingerprint} for {ns.name!r}, valid until {issued.expires}: {out}")
    elif ns.token_action == "revoke":
        revoked = access.revoke_tokens(key, ns.name)
        listed = access.count_tokens(revoked.listed, "revoked")
        print(
            f"revoked {access.count_tokens(revoked.now)} of {ns.name!r} (the revocation list now holds "
            f"{listed}); a running monitor tells the swarm within seconds"
            if revoked.now
            else f"the tokens of {ns.name!r} were already revoked (the revocation list holds {listed})"
        )
    else:
        rows = access.list_tokens(key)
        if ns.json:
            for row in rows:
                print(json.dumps(row))
        else:
            print("\n".join(access.token_table(rows)) if rows else f"no tokens issued with {key}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    command = command if command in DESCRIPTIONS else ""
    try:
        ns, config = parse(argv)
        if ns.command == "config":
            return cmd_config(config)
        if ns.command == "prepare":
            return cmd_prepare(config)
        if ns.command == "export":
            return cmd_export(ns.checkpoint, ns.out_dir)
        if ns.command == "status":
            return cmd_status(config)
        if ns.command == "token":
            return cmd_token(ns)
        if ns.command in ("train", "monitor", "eval"):
            from cotrain.host.procs import supervise  # deferred: loaded by its subcommand only

            if ns.command in ("train", "monitor"):
                check_local_paths(ns.command, config)
            if ns.command == "monitor":
                config = monitor_config(ns, config)
            return supervise(ns.command, config)
        if ns.command == "demo":
            from cotrain.demo import run_demo  # deferred: loaded by its subcommand only

            return run_demo(config)
    except UserError as e:
        return fail(command, str(e))
    except OSError as e:  # the file system refused (read-only, full, missing folder): one line, no traceback
        return fail(command, describe_os_error(e))
    except KeyboardInterrupt:
        print(f"cotrain {command}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
