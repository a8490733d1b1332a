"""Where the monitor writes the swarm's metrics: one interface, several sinks.

JSONL is always on; TensorBoard and wandb are optional extras; the Prometheus sink backs the dashboard's
``/metrics`` endpoint. A sink that fails is logged and dropped, never the monitor.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cotrain.sinks.base import Sink
from cotrain.sinks.jsonl import JsonlSink

logger = logging.getLogger(__name__)

__all__ = ["Sink", "JsonlSink", "SinkSet", "build_sinks"]


class SinkSet(Sink):
    """Several sinks written together; one that raises is closed and removed with a warning."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = list(sinks)

    def write(self, step: int, metrics: dict) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception as e:
                logger.warning(f"{type(sink).__name__} failed and is disabled: {e!r}")
                self.sinks.remove(sink)
                _close_quietly(sink)

    def close(self) -> None:
        for sink in self.sinks:
            _close_quietly(sink)
        self.sinks = []


def _close_quietly(sink: Sink) -> None:
    try:
        sink.close()
    except Exception as e:
        logger.debug(f"closing {type(sink).__name__}: {e!r}")


def build_sinks(out_dir: Path, run_id: str, tensorboard_dir: str = "", wandb_project: str = "") -> SinkSet:
    """JSONL in ``out_dir/metrics.jsonl`` plus the optional sinks that were asked for (a missing extra
    is one log line saying how to install it)."""
    sinks: list[Sink] = [JsonlSink(out_dir / "metrics.jsonl")]
    if tensorboard_dir:
        try:
            from cotrain.sinks.tensorboard import TensorBoardSink  # deferred: an optional dependency

            sinks.append(TensorBoardSink(tensorboard_dir))
            logger.info(f"Writing TensorBoard event files to {tensorboard_dir}")
        except ImportError as e:
            logger.warning(f"--tensorboard-dir needs TensorBoard ({e}): pip install 'cotrain[tensorboard]'")
    if wandb_project:
        try:
            from cotrain.sinks.wandb import WandbSink  # deferred: an optional dependency

            sinks.append(WandbSink(wandb_project, run_id, out_dir))
        except ImportError as e:
            logger.warning(f"--wandb-project needs wandb ({e}): pip install 'cotrain[wandb]'")
        except Exception as e:  # no login, no network: the monitor goes on without it
            logger.warning(f"wandb could not start, metrics go to the other sinks only: {e!r}")
    return SinkSet(sinks)
