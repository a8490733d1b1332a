"""cotrain.optim.

Here, in the test process alone; the rest in tests/live/test_optim.py."""

from __future__ import annotations

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


@pytest.mark.parametrize("weight_decay, clamp", [(0.01, 10.0), (0.0, 0.5)])
def test_lamb_takes_torch_optimizers_steps_and_keeps_its_state_entries(weight_decay, clamp):
    from cotrain.optim import Lamb

    torch_optimizer = pytest.importorskip("torch_optimizer")  # the package cotrain's LAMB replaces
    torch.manual_seed(0)
    start = [torch.randn(16, 8), torch.randn(8), torch.zeros(4)]  # a zero tensor: trust ratio 1
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    kwargs = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=weight_decay, clamp_value=clamp)
    mine, reference = Lamb(ours, **kwargs), torch_optimizer.Lamb(theirs, debias=True, **kwargs)
    for _ in range(30):
        grads = [torch.randn_like(t) for t in start]
        for params, opt in ((ours, mine), (theirs, reference)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b, before in zip(ours, theirs, start, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, before)  # it moved
    assert mine.state_dict()["state"].keys() == reference.state_dict()["state"].keys()
    for key in ("step", "exp_avg", "exp_avg_sq", "weight_norm", "adam_norm", "trust_ratio"):
        assert key in mine.state[ours[0]]
    # a state saved by one loads into the other (checkpoints carry over)
    Lamb(theirs, **kwargs).load_state_dict(reference.state_dict())


def test_lamb_refuses_bad_settings():
    from cotrain.optim import Lamb

    param = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        Lamb(param, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        Lamb(param, lr=-1.0)
