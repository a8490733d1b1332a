"""TensorBoard event files (``--tensorboard-dir``); needs the ``tensorboard`` extra."""

from __future__ import annotations

from pathlib import Path

from cotrain.sinks.base import Sink, scalars


class TensorBoardSink(Sink):
    def __init__(self, log_dir: str | Path):
        import tensorboard  # noqa: F401  (torch's writer needs it; fail here with a clear ImportError)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: dict) -> None:
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(f"swarm/{name}", value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
