"""cotrain.optim.

Here, with cotrain processes; the rest in tests/unit/test_optim.py."""

from __future__ import annotations

import subprocess
import sys


def test_the_optimizer_side_imports_no_transformers():
    code = (
        "import sys, torch\n"
        "from cotrain.config import resolve\n"
        "from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory\n"
        "run = resolve('albert-tiny').run\n"
        "model = torch.nn.Linear(4, 4)\n"
        "scheduler_factory(run)(optimizer_factory(run)(parameter_groups(model, run.weight_decay)))\n"
        "print('transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
