"""The worker half of a supervised role (see cotrain.host.procs):
``python -m cotrain._worker ROLE --resolved-config FILE``, FILE holding the resolved config as JSON (``-``:
on standard input, as the supervisor and rank 0 hand it)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

from cotrain.cli import fail
from cotrain.config import Config, load_resolved, write_toml
from cotrain.errors import UserError
from cotrain.host.deferred import defer_all
from cotrain.host.procs import StopSignals, exit_worker, supervisor_pid
from cotrain.net.logs import quiet_while_stopping

ROLES = ("train", "monitor", "eval")


def setup_logging(verbose: bool) -> None:
    from hivemind.utils.logging import use_hivemind_log_handler  # deferred: the role this worker runs

    from cotrain.net.logs import one_line_errors  # deferred: the role this worker runs

    use_hivemind_log_handler("in_root_logger")
    if not verbose:
        one_line_errors()
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("urllib3", "filelock", "datasets", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def role_class(command: str) -> type:
    if command == "train":
        from cotrain.host.ranks import rank_env  # deferred: the role this worker runs

        if (rank_env() or (0,))[0] > 0:  # a rank other than 0 of a peer of several ranks
            from cotrain.roles.ranks import RankFollower  # deferred: the role this worker runs

            return RankFollower
        from cotrain.roles.trainer import Trainer  # deferred: the role this worker runs

        return Trainer
    if command == "monitor":
        from cotrain.roles.monitor import Monitor  # deferred: the role this worker runs

        return Monitor
    from cotrain.roles.evaluator import Evaluator  # deferred: the role this worker runs

    return Evaluator


def write_output_config(config: Config) -> Path:
    """The resolved config as OUTPUT_DIR/config.toml ([run] and [peer]: `--config` reads it back)."""
    return write_toml(config, Path(config.peer.output_dir) / "config.toml")


def refusal_of(role) -> str | None:
    """Why the swarm stopped accepting the role's access token while it ran (a private swarm), if it did."""
    connection = getattr(role, "connection", None)
    return getattr(connection, "refusal", None)


def run_role(command: str, resolved_config: str) -> int:
    """Run one role; its error, if any, is the last line it prints: the role is shut down first, so that no
    background thread or averager process logs after it. A role the swarm refused (its access token revoked
    or expired) says so in that line alone, whatever else its stop caused."""
    role = None
    error: str | None = None
    try:
        config = load_resolved(resolved_config)
        setup_logging(config.peer.verbose)
        write_output_config(config)
        signals = StopSignals().install()
        quiet_while_stopping(signals.event)
        from cotrain.net.probe import AccessWatcher  # deferred: the role this worker runs

        AccessWatcher.logs_refusal = False  # this worker prints the refusal, as the role's error line
        role = role_class(command)(config, stop=signals.event)
        code = 1
        try:
            code = role.run()
        except UserError as e:
            error = str(e)
        except Exception as e:
            if refusal_of(role) is None:
                logging.getLogger("cotrain").exception(f"{command} failed: {e!r}")
                return 1
            logging.getLogger("cotrain").debug(f"{command} stopped after the swarm refused it: {e!r}")
        error = refusal_of(role) or error
        if error is None:
            return code
    except UserError as e:
        error = str(e)
    except OSError as e:  # OUTPUT_DIR/config.toml could not be written
        error = f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
    finally:
        if role is not None:
            try:
                role.close()
            except Exception as e:
                logging.getLogger("cotrain").debug(f"shutdown: {e!r}")
    sys.stdout.flush()
    return fail(command, error)


def share_pages_with_children() -> None:
    """With ``--swarm-processes`` the DHT and the averagers are forked from this process after torch,
    transformers and the model are loaded: their pages are shared until written. Before each fork the garbage
    collector collects, then freezes what is left (``freeze_before_fork``), and the objects stay frozen in the
    parent as in the child: neither process's collections write to (and so copy) the pages of the objects
    they share."""
    os.register_at_fork(before=freeze_before_fork)


def freeze_before_fork() -> None:
    """Collect the garbage there is, then move every object left out of the collector's reach for good. A
    full collection writes to every object it examines; one in the parent after the fork (rare: CPython
    collects the oldest generation only when it has grown by a quarter) copied every page of the objects it
    shared with its children, 50-130 MB at once, which the children then kept alone (cotrain's endurance run).
    Frozen objects are still freed when nothing refers to them; only reference cycles among them are not."""
    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    defer_all()  # before anything imports hivemind
    share_pages_with_children()
    parser = argparse.ArgumentParser(prog="python -m cotrain._worker")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--resolved-config", required=True, metavar="FILE")
    args = parser.parse_args(argv)
    return run_role(args.role, args.resolved_config)


if __name__ == "__main__":
    exit_worker(main(sys.argv[1:]), supervisor_pid())
