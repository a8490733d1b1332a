"""torch.compile's tracer kept out of a process that never compiles (cotrain.host.nocompile)."""

from __future__ import annotations

import subprocess
import sys

import pytest

STEPS = """
import sys
import torch
from cotrain.optim import Lamb
from cotrain.host.nocompile import keep_dynamo_out
marked = keep_dynamo_out() if sys.argv[1] == "keep-out" else 0
param = torch.nn.Parameter(torch.zeros(3))
optimizer = Lamb([param], lr=0.1)  # the ALBERT and BERT presets'
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
param.grad = torch.ones(3)
optimizer.step()
schedule.step()
optimizer.zero_grad()
optimizer.load_state_dict(optimizer.state_dict())
assert param.detach().lt(0).all(), param
print(marked, "torch._dynamo" in sys.modules, keep_dynamo_out())
"""


@pytest.mark.parametrize("mode, imported", [("keep-out", "False"), ("as-is", "True")])
def test_lamb_and_its_schedule_run_without_importing_torch_compile(mode, imported):
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    marked, dynamo, again = done.stdout.split()
    assert dynamo == imported
    if mode == "keep-out":
        assert int(marked) > 10 and again == "0"  # marked once; nothing left to mark
    else:
        assert again == "0"  # too late: torch._dynamo is in
