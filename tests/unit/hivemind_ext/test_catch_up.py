"""A peer the swarm left behind (cotrain.hivemind_ext.optimizer.SwarmOptimizer.left_behind).

Here, in the test process alone; the rest in tests/live/test_catch_up.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage

from cotrain.hivemind_ext.optimizer import SwarmOptimizer


def optimizer(own=4, swarm=5, peers=2, samples=8, target=32, stage=None, reloaded=None, auxiliary=False):
    """The fields left_behind reads, as hivemind's Optimizer holds them."""
    control = None
    if stage is not None:
        control = SimpleNamespace(stage=stage, done=lambda: stage is AveragingStage.FINISHED)
    return SimpleNamespace(
        auxiliary=auxiliary,
        use_gradient_averaging=True,
        local_epoch=own,
        tracker=SimpleNamespace(global_epoch=swarm, global_progress=SimpleNamespace(num_peers=peers)),
        scheduled_grads=control,
        grad_averager=SimpleNamespace(local_samples_accumulated=samples),
        target_batch_size=target,
        _reloaded_behind=reloaded,
    )


@pytest.mark.parametrize(
    "fields, behind",
    [
        ({}, True),  # 8 samples, a share of 16: the state instead
        ({"stage": AveragingStage.LOOKING_FOR_GROUP}, True),  # still looking: nobody averages step 4 any more
        ({"stage": AveragingStage.FINISHED}, True),
        ({"own": 5}, False),  # in step with the swarm
        ({"peers": 1}, False),  # alone in the swarm: stepping alone is all there is
        ({"samples": 16}, False),  # its share of a step: hivemind steps on it
        ({"stage": AveragingStage.AWAITING_TRIGGER}, False),  # a group will average its gradient
        ({"stage": AveragingStage.RUNNING_ALLREDUCE}, False),
        ({"reloaded": (4, 5)}, False),  # a download at these steps was tried already: step as hivemind does
        ({"reloaded": (3, 4)}, True),
        ({"auxiliary": True}, False),
    ],
)
def test_a_peer_left_behind_with_a_few_samples_loads_the_state(fields, behind):
    assert SwarmOptimizer.left_behind(optimizer(**fields)) is behind
