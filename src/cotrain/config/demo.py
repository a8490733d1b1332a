"""Options of `cotrain demo` itself (the run and peer settings it takes reach each of its peers)."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import opt

# `cotrain demo --strategy diloco` without --local-steps: rounds of 5 x target_batch_size samples instead of
# RunConfig's 50, so that the demo's 8 outer rounds take about a minute on 2 CPU cores (about 7 with 50)
DEMO_LOCAL_STEPS = 5


@dataclass
class DemoConfig:
    """Options of `cotrain demo` (a whole swarm on this machine). With --strategy diloco and no --local-steps,
    the demo's rounds are --local-steps 5 (not 50), so that its outer rounds take about a minute on 2 cores;
    --steps then counts outer rounds."""

    TITLE: ClassVar[str] = "demo"

    peers: int = opt(2, "Number of trainer peers to start (at least 2).", roles=("demo",))
    steps: int = opt(
        8, "Global steps (diloco: outer rounds) to train before stopping (at least 2).", roles=("demo",)
    )
    deadline: float = opt(
        540.0, "Seconds after which the demo stops even if the steps are not done.", roles=("demo",)
    )

    def problems(self) -> list[str]:
        problems = []
        if self.peers < 2 or self.steps < 2:
            problems.append(
                "demo peers and steps must be at least 2 (peers that average with each other, and steps "
                "enough to see the loss fall)"
            )
        if self.deadline <= 0:
            problems.append(f"deadline must be positive, got {self.deadline}")
        return problems
