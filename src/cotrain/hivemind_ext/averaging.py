"""The gradient averager of cotrain's trainers: hivemind's GradientAverager with the settings cotrain uses.

hivemind.Optimizer builds its gradient averager from ``grad_averager_factory`` and does not pass it
``averager_opts`` (those reach only the state averager), so the settings travel in the factory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from hivemind.averaging.allreduce import AveragingMode
from hivemind.optim.grad_averager import GradientAverager

from cotrain.algorithms.aggregation import Aggregation, Mean
from cotrain.hivemind_ext.auxiliary import AUX_GATHER
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.liveness import WatchedRounds
from cotrain.hivemind_ext.reducers import RobustAveraging

# Parts of its tensors that an all-reduce reads ahead from each stream. A reducer returns a part's average
# only once every sender's copy of it has arrived, and reads a sender's next part only after that; reading
# 8 or 32 parts ahead made no measurable difference at n = 4 (docs/benchmarks.md, all-reduce), so
# hivemind's default of 1 stays.
READ_AHEAD_PARTS = 1


class SwarmGradientAverager(ServedInThread, RobustAveraging, GradientAverager, WatchedRounds):
    """hivemind's GradientAverager, as cotrain's trainers run it: ``read_ahead`` parts of each all-reduce
    stream are received, decoded and held while the reducer waits for the other senders; reducers combine
    the parts with ``aggregation`` (cotrain.hivemind_ext.reducers); with ``direct`` (on by default), parts go
    over direct TCP connections where the peers can reach each other (cotrain.hivemind_ext.direct).

    It shares no state: hivemind's would be the peer's gradient accumulators, which a newcomer that
    downloaded them resets at once (``load_state_bounded``). Serving them sent a model-sized buffer of raw
    gradients to every newcomer, and hivemind's download of them has no timeout for opening the stream: in a
    16-trainer swarm a newcomer waited on it for minutes (docs/benchmarks.md, scale)."""

    def __init__(
        self,
        *args,
        read_ahead: int = READ_AHEAD_PARTS,
        aggregation: Aggregation = Mean(),
        start: bool = False,
        **kwargs,
    ) -> None:
        self.aggregation = aggregation
        kwargs["allow_state_sharing"] = False
        super().__init__(*args, start=False, **kwargs)
        # handed by hivemind's averager to each AllReduceRunner, and by it to its TensorPartContainer
        self.allreduce_kwargs["prefetch"] = read_ahead
        if start:  # the averager's process starts with these settings in place
            self.run_in_background(await_ready=True)

    def schedule_step(self, scheduled_time: float | None = None, **kwargs):
        """hivemind's, except that an auxiliary reducer says so to its group
        (cotrain.hivemind_ext.auxiliary)."""
        if self.mode == AveragingMode.AUX and kwargs.get("gather") is None:
            kwargs["gather"] = AUX_GATHER
        return super().schedule_step(scheduled_time, **kwargs)


def gradient_averager_factory(averager_opts: dict | None = None) -> Callable[..., SwarmGradientAverager]:
    """The ``grad_averager_factory`` for hivemind.Optimizer: the peer's averager options (group size,
    request timeout, bandwidth, ``read_ahead``, ``aggregation``, ``direct``) on top of the arguments
    hivemind.Optimizer passes itself."""
    opts = dict(averager_opts or {})
    if opts.get("read_ahead", READ_AHEAD_PARTS) < 1:
        raise ValueError(f"read_ahead must be at least 1, got {opts['read_ahead']}")
    return functools.partial(SwarmGradientAverager, **opts)
