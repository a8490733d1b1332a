"""PeerConfig: every per-peer setting in one flat dataclass (``config.peer.X``), made of the per-peer
components; each component validates its own fields."""

import dataclasses
import functools
from dataclasses import dataclass

from cotrain.config.averaging import AveragingConfig
from cotrain.config.data import DataConfig
from cotrain.config.evaluation import EvaluationConfig
from cotrain.config.fields import finite_problems
from cotrain.config.general import GeneralConfig
from cotrain.config.monitor import MonitorConfig
from cotrain.config.network import NetworkConfig
from cotrain.config.trainer import TrainerConfig

# in the order the CLI's help shows them
PEER_COMPONENTS: tuple[type, ...] = (
    NetworkConfig,
    DataConfig,
    TrainerConfig,
    AveragingConfig,
    MonitorConfig,
    EvaluationConfig,
    GeneralConfig,
)


# dataclasses collect fields from the last base to the first: the bases are PEER_COMPONENTS reversed, so
# that the fields come in PEER_COMPONENTS' order
@dataclass
class PeerConfig(
    GeneralConfig,
    EvaluationConfig,
    MonitorConfig,
    AveragingConfig,
    TrainerConfig,
    DataConfig,
    NetworkConfig,
):
    """Per-peer settings: each peer chooses its own."""

    def problems(self) -> list[str]:
        problems = finite_problems(self)
        for component in PEER_COMPONENTS:
            problems += component.problems(self)
        return problems


@functools.cache
def component_of(name: str) -> type:
    """The per-peer component that declares field ``name``."""
    return next(c for c in PEER_COMPONENTS if name in {f.name for f in dataclasses.fields(c)})
