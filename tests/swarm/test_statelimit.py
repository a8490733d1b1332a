"""The cap on a state download (cotrain.algorithms.statelimit).

Here, with hivemind in the test process; the rest in tests/unit/algorithms/test_statelimit.py."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import CompressionInfo
from hivemind.optim.state_averager import dump_optimizer_state

from conftest import state_holder, wait_until
from cotrain.hivemind_ext import statecheck as sc


class BloatedHolder(sc.CheckedTrainingStateAverager):
    """A state holder that serves its state and 8 MiB of tensors more."""

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        extra = [torch.zeros(1 << 18) for _ in range(8)]
        return metadata, [*tensors, *extra], [*infos, *(CompressionInfo.from_tensor(t) for t in extra)]


@pytest.mark.timeout(120)
def test_a_newcomer_refuses_a_donor_that_serves_more_than_its_own_state_and_loads_the_next():
    """Real holders on DHTs on 127.0.0.1: an honest one at step 16, whose Adam has taken a step, and one at
    step 19 (asked first) that serves 8 MiB of tensors more than the model's state. The newcomer, whose
    optimizer holds no statistics yet, refuses the larger stream and loads step 16."""

    run_id = "statelimit"
    dhts, holders = [], []

    def holder(kind: type, epoch: int | None) -> sc.CheckedTrainingStateAverager:
        made = state_holder(dhts, run_id, epoch, kind, lambda params: torch.optim.Adam(params, lr=0.1))
        holders.append(made)
        return made

    try:
        honest = holder(sc.CheckedTrainingStateAverager, 16)
        for param in honest.main_parameters:
            param.grad = torch.ones_like(param)
        honest.step(optimizer_step=True)  # Adam builds its statistics at its first step
        assert honest.optimizer.state
        holder(BloatedHolder, 19)
        offered = f"{run_id}_state_averager.all_averagers"
        wait_until(
            lambda: len((dhts[0].get(offered, latest=True) or [{}])[0]) == 2, 30, what="both holders to serve"
        )
        _, tensors, _ = honest.get_current_state()
        newcomer = holder(sc.CheckedTrainingStateAverager, None)
        # as an optimizer that builds its statistics at its first step holds none: its own state is the
        # parameters alone, fewer tensors than the donors serve; the bound comes from the parameters
        newcomer.optimizer.state.clear()
        own = len(dump_optimizer_state(newcomer.optimizer)[1]) + len(newcomer.main_parameters)
        assert own < len(tensors) <= newcomer.state_bound()[0]
        newcomer.load_state_from_peers(timeout=30)
        assert newcomer.local_epoch == 16
    finally:
        for made in holders:
            made.shutdown()
        for dht in dhts:
            dht.shutdown()
