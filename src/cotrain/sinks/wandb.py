"""Weights & Biases (``--wandb-project``); needs the ``wandb`` extra. ``WANDB_MODE=offline`` writes the run to
``OUTPUT/wandb/offline-run-*`` for a later ``wandb sync``."""

from __future__ import annotations

from pathlib import Path

from cotrain.sinks.base import Sink, scalars


class WandbSink(Sink):
    def __init__(self, project: str, run_id: str, out_dir: str | Path):
        import wandb

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_id, dir=str(out_dir), config={"run_id": run_id})

    def write(self, step: int, metrics: dict) -> None:
        if metrics.get("kind") == "eval":  # its step (the evaluated state's) may lie behind: wandb's grow
            self.run.log({**scalars(metrics), "eval_step": step})
            return
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()
