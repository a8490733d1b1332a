"""The seed documents' command lines (../shared/seeds, or their lines kept in tests/assets/seeds), as a user
would type them."""

from __future__ import annotations

import re
import shlex

from conftest import SEEDS_DIR

SEEDS = SEEDS_DIR  # the seed documents (../shared/seeds), or their command lines in tests/assets/seeds


ROLE_OF_SCRIPT = {"run_trainer": "train", "run_training_monitor": "monitor", "run_first_peer": "monitor"}


PEER = "/ip4/203.0.113.1/tcp/31337/p2p/12D3KooWJrjcn5rje613dU6yRwAXg45UVMSqWDwdNkbEg9G9MSJU"


# placeholders of the seed documents -> values a user would type
PLACEHOLDERS = {
    "ONE_OR_MORE_PEERS": PEER,
    "BATCH_SIZE_FOR_YOUR_GPU": "auto",
    "{microbatch_size}": "4",
}


COMMAND = re.compile(
    r"(?:^|`|\s)(?:!|\+ )?(?:[A-Z_]+=\S+\s+)*(?:python\s+)?(?:\./)?(?:[\w.-]+/)*"
    r"(?P<script>run_trainer|run_training_monitor|run_first_peer)\.py(?P<args>[^`\n]*)"
)


def seed_commands() -> list[tuple[str, list[str], str]]:
    """(role, arguments, source line) of every command line of the original scripts in the seed documents,
    continuation lines joined."""
    out = []
    for path in sorted(SEEDS.glob("0*.txt")):
        text = re.sub(r"\\\n", " ", path.read_text())
        for line in text.splitlines():
            for m in COMMAND.finditer(line):
                args = m.group("args")
                for placeholder, value in PLACEHOLDERS.items():
                    args = args.replace(placeholder, value)
                out.append((ROLE_OF_SCRIPT[m.group("script")], shlex.split(args), line.strip()))
    return out
