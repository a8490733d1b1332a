"""cotrain.SwarmPeer, the API for training loops of one's own.

Here, in the test process alone; the rest in tests/live/test_api.py."""

from __future__ import annotations

import pytest
import torch

from conftest import (
    LOCALHOST,
)
from cotrain.errors import UserError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"optimizer": "adam"}, "optimizer must be a function"),
        ({"run_id": "a.b"}, "run_id 'a.b'"),
        ({"target_batch_size": 0}, "target_batch_size must be positive"),
        ({"grad_compression": "int3"}, "grad_compression must be one of fp16, 8bit, none"),
        ({"scheduler": 3}, "scheduler must be a function"),
        ({"delay_everything": True}, "unknown setting 'delay_everything'"),
    ],
)
def test_misuse_is_one_clear_error_before_the_network_starts(kwargs, message):
    import cotrain

    model = torch.nn.Linear(2, 2)
    args = {
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.1),
        "run_id": "api-test",
        "target_batch_size": 8,
        "host_maddrs": [LOCALHOST],
        **kwargs,
    }
    if args["optimizer"] == "adam":
        args["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)  # an instance, not a function
    with pytest.raises(UserError, match=message):
        cotrain.SwarmPeer(model, **args)
