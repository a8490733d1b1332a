"""The worker half of a supervised role (see cotrain.procs): ``python -m cotrain._worker ROLE ARGS...``."""

from __future__ import annotations

import logging
import os
import sys

from cotrain.cli import fail, parse
from cotrain.errors import UserError
from cotrain.procs import StopSignals


def setup_logging(verbose: bool) -> None:
    from hivemind.utils.logging import use_hivemind_log_handler

    from cotrain.swarm.logs import one_line_errors

    use_hivemind_log_handler("in_root_logger")
    if not verbose:
        one_line_errors()
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("urllib3", "filelock", "datasets", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_role(argv: list[str]) -> int:
    """Run one role; its error, if any, is the last line it prints: the role is shut down first, so that no
    background thread or averager process logs after it."""
    command = argv[0] if argv else ""
    role = None
    error: str | None = None
    try:
        ns, config = parse(argv)
        setup_logging(config.peer.verbose)
        if ns.command == "train":
            from cotrain.roles.trainer import Trainer as role_class
        elif ns.command == "monitor":
            from cotrain.roles.monitor import Monitor as role_class
        elif ns.command == "eval":
            from cotrain.roles.evaluator import Evaluator as role_class
        else:
            return fail(command, f"{command!r} is not a supervised role")
        signals = StopSignals().install()
        role = role_class(config, stop=signals.event)
        try:
            return role.run()
        except UserError as e:
            error = str(e)
        except Exception as e:
            logging.getLogger("cotrain").exception(f"{command} failed: {e!r}")
            return 1
    except UserError as e:
        error = str(e)
    finally:
        if role is not None:
            try:
                role.close()
            except Exception as e:
                logging.getLogger("cotrain").debug(f"shutdown: {e!r}")
    sys.stdout.flush()
    return fail(command, error)


if __name__ == "__main__":
    rc = run_role(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
