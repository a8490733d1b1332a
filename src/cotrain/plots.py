"""Static pictures of a run (matplotlib, the ``plots`` extra): the demo's loss curve."""

from __future__ import annotations

from pathlib import Path


def plot_loss(rows: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Loss against global step (and samples on a second axis) as a PNG; None when there is nothing to plot.

    Raises ImportError when matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["step"], r["loss"], r.get("samples", 0)) for r in rows if r.get("loss") is not None]
    if not points:
        return None
    steps, losses, samples = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    try:
        ax.plot(steps, losses, marker="o", markersize=3, linewidth=1.5, color="#2f6fde")
        ax.set_xlabel("global step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        if samples[-1] > 0 and steps[-1] > steps[0]:
            per_step = (samples[-1] - samples[0]) / (steps[-1] - steps[0]) or 1
            top = ax.secondary_xaxis(
                "top",
                functions=(
                    lambda s: samples[0] + (s - steps[0]) * per_step,
                    lambda n: steps[0] + (n - samples[0]) / per_step,
                ),
            )
            top.set_xlabel("samples (swarm total)")
        if title:
            ax.set_title(title, fontsize=10)
        fig.tight_layout()
        path = Path(path)
        tmp = path.with_name(path.stem + ".tmp.png")
        fig.savefig(tmp)
        tmp.replace(path)
        return path
    finally:
        plt.close(fig)
