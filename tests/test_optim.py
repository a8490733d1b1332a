"""cotrain.optim: the schedules are transformers' own, without importing transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from cotrain.config import resolve
from cotrain.errors import UserError
from cotrain.optim import SCHEDULES, scheduler_factory

THEIRS = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (10, 10), (5, 400), (1, 1)])
def test_each_schedule_gives_transformers_rates_step_by_step_and_the_same_state(name, warmup, total):
    ours, theirs = optimizer(), optimizer()
    our_schedule = SCHEDULES[name](ours, num_warmup_steps=warmup, num_training_steps=total)
    their_schedule = THEIRS[name](theirs, num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(total + 5):  # past the end too: the rate stays at 0
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], abs=1e-12)
        ours.step()
        theirs.step()
        our_schedule.step()
        their_schedule.step()
    assert our_schedule.state_dict().keys() == their_schedule.state_dict().keys()
    # a schedule saved by either (an older checkpoint's, a trainer's) continues in the other
    again = THEIRS[name](optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    again.load_state_dict(our_schedule.state_dict())
    assert again.last_epoch == our_schedule.last_epoch and again.get_last_lr() == our_schedule.get_last_lr()


def test_the_runs_schedule_and_an_unknown_one():
    run = resolve("albert-tiny").run
    schedule = scheduler_factory(run)(optimizer())
    assert schedule.get_last_lr() == [0.0]  # warmup starts from 0
    run.lr_scheduler = "step"
    with pytest.raises(UserError, match="choose one of linear, cosine"):
        scheduler_factory(run)


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
