"""What every role of a peer takes: where it writes, its seed, its CPU threads and how much it logs."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import ROLES_ALL, negative, opt


@dataclass
class GeneralConfig:
    """This peer: its output folder, seed, CPU threads and log verbosity."""

    TITLE: ClassVar[str] = "general"

    output_dir: str = opt(
        "outputs", "Folder for this peer's logs, metrics and checkpoints.", seed="--output_dir"
    )
    seed: int = opt(
        0,
        "Seed of this peer's data order and masking (each peer should use its own).",
        roles=ROLES_ALL + ("prepare",),
        seed="--seed",
    )
    torch_threads: int = opt(
        0,
        "CPU threads for torch on this peer (0: an equal share of this machine's cores among the cotrain "
        "peers running on it, followed as peers start and stop).",
    )
    verbose: bool = opt(False, "Log hivemind's status lines at INFO instead of DEBUG.")

    def problems(self) -> list[str]:
        return negative(self, "torch_threads")
