"""How the reducer of a part of an all-reduce combines the group's contributions to it: an ``Aggregation``
part, chosen by name (``--aggregation``, cotrain.registry). ``Mean`` is hivemind's weighted mean;
``CenteredClip`` is robust to malicious peers (cotrain.hivemind_ext.reducers explains how the reducers use
it).

An aggregation's ``combine(parts, weights)`` gets the senders' copies of one part (n x d, checked: the right
shape, finite) and their weights (the samples each sender reports, n) and returns the combined part (d) and,
per sender, whether its copy lay far outside what the aggregation accepts (None: it judges nobody), which
counts toward excluding that peer. ``robust`` aggregations also make the swarm count its progress robustly and
each peer bound what it applies (cotrain.hivemind_ext.progress, cotrain.hivemind_ext.reducers).

Every aggregation is built with the run's centered-clip settings (``tau``, ``iterations``) and the values of
the parameters its registry line declares (``options``: ``--aggregation-option NAME=VALUE``, settled by
``build``); an aggregation of one's own reads its own from ``self.options``.
"""

from __future__ import annotations

from typing import Any

import torch

from cotrain.algorithms.parameters import settle
from cotrain.registry import aggregation_class, aggregation_parameters

__all__ = ["Aggregation", "CenteredClip", "Mean", "build", "capped_weights", "centered_clip", "parse_tau"]

AUTO_TAU_FACTOR = 2.0  # auto tau: this many times the median distance of the contributions from the median
# centered-clip: a contribution weighs at most the median weight. A higher cap lets one peer that claims
# many samples outweigh the honest ones in a small group (at 4 x the median, one of 4 peers holds 57%).
WEIGHT_CAP = 1.0
FAR_OUTSIDE = 2.0  # a contribution this many times tau from the result counts as an outlier


class Aggregation:
    """The base of an aggregation part: its settings (``tau``: absolute, > 0, or None for auto;
    ``iterations``), which the ones that need them read, and the values of its declared parameters
    (``options``)."""

    name = ""
    robust = False

    def __init__(self, tau: float | None = None, iterations: int = 5, **options: Any) -> None:
        if tau is not None and not tau > 0:
            raise ValueError(f"clip tau must be positive (or auto), got {tau}")
        if iterations < 1:
            raise ValueError(f"clip iterations must be at least 1, got {iterations}")
        self.tau, self.iterations, self.options = tau, iterations, options

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def shares(self, weights: torch.Tensor) -> torch.Tensor | None:
        """For an aggregation that is a weighted sum of the contributions: each sender's coefficient (float64,
        summing to 1), so that a reducer adds the senders one at a time into one running sum; None for one
        that needs every contribution at once."""
        return None

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), *self._settings()))

    def __repr__(self) -> str:
        options = "".join(f", {name}={value!r}" for name, value in sorted(self.options.items()))
        return f"{type(self).__name__}(tau={self.tau}, iterations={self.iterations}{options})"

    def _settings(self) -> tuple:
        return self.tau, self.iterations, tuple(sorted(self.options.items()))


class Mean(Aggregation):
    """The mean weighted by the samples each sender reports (equal weights when all report none)."""

    name = "mean"

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.shares(weights).to(parts.dtype) @ parts, None

    def shares(self, weights: torch.Tensor) -> torch.Tensor:
        """The weights divided by their sum, in float64 (no sum of float32 weights can overflow there)."""
        weights = weights.double()
        total = weights.sum()
        return weights / total if total > 0 else torch.full_like(weights, 1 / len(weights))


class CenteredClip(Aggregation):
    """CenteredClip over the senders' copies, their weights capped at the median; a copy farther than
    ``FAR_OUTSIDE`` x tau from the result counts as an outlier."""

    name = "centered-clip"
    robust = True

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        result, distance, _ = centered_clip(parts, capped_weights(weights), self.tau, self.iterations)
        return result, distance > FAR_OUTSIDE


def build(name: str, tau: float | None = None, iterations: int = 5, **options: Any) -> Aggregation:
    """The aggregation registered as ``name`` (cotrain.registry), with its settings and the values of its
    declared parameters (``options`` over their defaults; ValueError naming every unknown name or bad
    value)."""
    values = settle(f"aggregation {name}", aggregation_parameters(name), options)
    return aggregation_class(name)(tau=tau, iterations=iterations, **values)


def parse_tau(value: str | float | None) -> float | None:
    """``--clip-tau``: "auto" (None) or a positive number."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    tau = float(value)
    if not tau > 0:
        raise ValueError(f"clip tau must be positive or auto, got {value!r}")
    return tau


def capped_weights(weights: torch.Tensor, cap: float = WEIGHT_CAP) -> torch.Tensor:
    """Weights capped at ``cap`` times their median (a minority cannot move the median)."""
    if len(weights) == 0:
        return weights
    limit = cap * weights.median()
    return torch.minimum(weights, limit) if limit > 0 else weights


@torch.no_grad()
def centered_clip(
    parts: torch.Tensor, weights: torch.Tensor, tau: float | None, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """CenteredClip of ``parts`` (n x d) with ``weights`` (n). Returns (the result, each contribution's
    distance from it in units of tau, the tau used)."""
    parts = parts.float()
    weights = weights.float()
    total = weights.sum()
    if total <= 0:
        weights, total = torch.ones_like(weights), torch.tensor(float(len(weights)))
    center = parts.median(dim=0).values if len(parts) > 2 else parts.mean(dim=0)
    if tau is None:
        distances = (parts - center).norm(dim=1)
        tau = AUTO_TAU_FACTOR * distances.median().item()
        if not tau > 0:  # most contributions equal: any that differs is clipped to nothing
            tau = torch.finfo(torch.float32).tiny
    for _ in range(iterations):
        diff = parts - center
        scale = (tau / diff.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0)
        center = center + (weights * scale) @ diff / total
    distance = (parts - center).norm(dim=1) / tau
    return center, distance, tau
