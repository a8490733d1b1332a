"""What the dashboard shows, kept by the monitor between refreshes (thread-safe; no web dependencies)."""

from __future__ import annotations

import threading
import time
from collections import deque

from cotrain.registry import DEFAULT_STRATEGY, strategy_class

HISTORY = 20_000  # global steps kept for the charts
PEER_HISTORY = 5_000  # alive-peer samples kept
EVAL_HISTORY = 5_000  # evaluations kept
ALIVE_RESOLUTION = 30.0  # seconds: an unchanged peer count adds a point at most this often


class SwarmView:
    """``strategy`` and ``local_steps`` are the run's: with diloco a global step is an outer round of
    ``local_steps x target_batch_size`` samples, and the page also shows inner steps and bytes per round."""

    def __init__(
        self,
        run_id: str,
        join_command: str,
        target_batch_size: int,
        strategy: str = DEFAULT_STRATEGY,
        local_steps: int = 1,
    ):
        self._view_lock = threading.Lock()
        self.run_id = run_id
        self.join_command = join_command
        self.target_batch_size = target_batch_size
        self.strategy = strategy
        # a global step is local_steps x target_batch_size samples where the strategy's steps are rounds
        self.kind = strategy_class(strategy)  # what the page shows of the strategy
        per_step = self.kind.samples_per_step(target_batch_size, local_steps)
        self.local_steps = per_step // target_batch_size if target_batch_size else 1
        self.steps: deque[dict] = deque(maxlen=HISTORY)
        self.alive: deque[tuple[float, int]] = deque(maxlen=PEER_HISTORY)
        self.state: dict = {}
        self.checkpoint: dict | None = None  # the newest checkpoint the monitor kept (record_checkpoint)
        self.evaluation: dict | None = None  # filled in once an evaluation peer reports
        self.evaluations: deque[dict] = deque(maxlen=EVAL_HISTORY)
        self.started = time.time()

    def add_step(self, row: dict) -> None:
        with self._view_lock:
            self.steps.append(dict(row))

    def add_evaluation(self, row: dict) -> None:
        """An evaluation peer's record (cotrain.roles.monitor.eval_row): the latest is shown, all charted."""
        with self._view_lock:
            self.evaluations.append(dict(row))
            if self.evaluation is None or row["step"] >= self.evaluation["step"]:
                self.evaluation = {k: v for k, v in row.items() if k != "kind"}

    def record_checkpoint(self, step: int, path: str) -> None:
        """The monitor kept a checkpoint of global step ``step`` in ``path``: the newest one is shown."""
        with self._view_lock:
            if self.checkpoint is None or step > self.checkpoint["step"]:
                self.checkpoint = {"step": int(step), "path": str(path), "time": time.time()}

    def update(self, state: dict) -> None:
        with self._view_lock:
            self.state = dict(state)
            point = (round(state.get("time", time.time()), 2), int(state.get("num_peers", 0)))
            a = self.alive
            if len(a) >= 2 and a[-1][1] == a[-2][1] == point[1] and a[-1][0] - a[-2][0] < ALIVE_RESOLUTION:
                a[-1] = point  # extend a flat stretch instead of adding a point: hours fit in the history
            else:
                a.append(point)

    def to_json(self) -> dict:
        with self._view_lock:
            return {
                "run_id": self.run_id,
                "join_command": self.join_command,
                "target_batch_size": self.target_batch_size,
                "strategy": self.strategy,
                "step_name": self.kind.step_name,
                "peer_fields": list(self.kind.peer_fields),
                "local_steps": self.local_steps,
                "step_samples": self.target_batch_size * self.local_steps,
                "started": self.started,
                "steps": list(self.steps),
                "alive": [list(a) for a in self.alive],
                "state": self.state,
                "checkpoint": self.checkpoint,
                "evaluation": self.evaluation,
                "evaluations": list(self.evaluations),
                "now": time.time(),
            }
