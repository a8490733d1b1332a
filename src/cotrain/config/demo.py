"""Options of `cotrain demo` itself (the run and peer settings it takes reach each of its peers)."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import opt


@dataclass
class DemoConfig:
    """Options of `cotrain demo` (a whole swarm on this machine)."""

    TITLE: ClassVar[str] = "demo"

    peers: int = opt(2, "Number of trainer peers to start.", roles=("demo",))
    steps: int = opt(8, "Global steps to train before stopping.", roles=("demo",))
    deadline: float = opt(
        540.0, "Seconds after which the demo stops even if the steps are not done.", roles=("demo",)
    )

    def problems(self) -> list[str]:
        problems = []
        if self.peers < 1 or self.steps < 1:
            problems.append("demo peers and steps must be at least 1")
        if self.deadline <= 0:
            problems.append(f"deadline must be positive, got {self.deadline}")
        return problems
