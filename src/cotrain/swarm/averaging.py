"""The gradient averager of cotrain's trainers: hivemind's GradientAverager with the settings cotrain uses.

hivemind.Optimizer builds its gradient averager from ``grad_averager_factory`` and does not pass it
``averager_opts`` (those reach only the state averager), so the settings travel in the factory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from hivemind.optim.grad_averager import GradientAverager


class SwarmGradientAverager(GradientAverager):
    """hivemind's GradientAverager, as cotrain's trainers run it."""


def gradient_averager_factory(averager_opts: dict | None = None) -> Callable[..., SwarmGradientAverager]:
    """The ``grad_averager_factory`` for hivemind.Optimizer: the peer's averager options (group size,
    request timeout, bandwidth) on top of the arguments hivemind.Optimizer passes itself."""
    return functools.partial(SwarmGradientAverager, **(averager_opts or {}))
