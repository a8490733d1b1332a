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

    use_hivemind_log_handler("in_root_logger")
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    for noisy in ("urllib3", "filelock", "datasets", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_role(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    role = None
    try:
        ns, config = parse(argv)
        setup_logging(config.peer.verbose)
        if ns.command == "train":
            from cotrain.roles.trainer import StopTraining, Trainer

            role = Trainer(config, stop=None)  # type: ignore[arg-type]

            def interrupt_step() -> None:
                if role.in_step:
                    raise StopTraining()

            signals = StopSignals(on_stop=interrupt_step).install()
        elif ns.command == "monitor":
            from cotrain.roles.monitor import Monitor

            signals = StopSignals().install()
            role = Monitor(config, stop=None)  # type: ignore[arg-type]
        else:
            return fail(command, f"{command!r} is not a supervised role")
        role.stop = signals.event
        try:
            return role.run()
        except UserError as e:
            return fail(command, str(e))
        except Exception as e:
            if type(e).__name__ == "StopTraining":
                return 0
            logging.getLogger("cotrain").exception(f"{command} failed: {e!r}")
            return 1
    except UserError as e:
        return fail(command, str(e))
    finally:
        if role is not None:
            try:
                role.close()
            except Exception as e:
                logging.getLogger("cotrain").debug(f"shutdown: {e!r}")


if __name__ == "__main__":
    rc = run_role(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
