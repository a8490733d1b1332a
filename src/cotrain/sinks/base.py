"""The one interface every metrics sink implements."""

from __future__ import annotations


class Sink:
    """Receives one row of swarm metrics per global step."""

    def write(self, step: int, metrics: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def scalars(metrics: dict) -> dict[str, float]:
    """The numeric entries of a metrics row worth plotting (not the step itself, not wall-clock time)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool)
    }
