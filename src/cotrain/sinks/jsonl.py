"""The always-on sink: one JSON object per global step, appended to ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

from cotrain.sinks.base import Sink


class JsonlSink(Sink):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: readers see whole lines

    def write(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        self._file.close()
