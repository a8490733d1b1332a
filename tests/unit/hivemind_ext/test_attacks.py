"""Fault injection of malicious peers (cotrain.faults, COTRAIN_ATTACK).

Here, in the test process alone; the rest in tests/live/test_attacks.py and tests/swarm/test_attacks.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from cotrain import faults
from cotrain.faults import ATTACK, ATTACK_SCALE, Attack, attack_batches, shuffle_labels, silent_allreduce


def gradients(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_an_honest_peer_sends_what_it_computed():
    params = gradients()
    before = flat([p.grad for p in params]).clone()
    assert Attack().before_step(params, 8) == 8
    assert torch.equal(flat([p.grad for p in params]), before)
    own = [p.grad.clone() for p in params]
    assert all(a is b for a, b in zip(Attack().pseudo_gradient(own), own, strict=True))


def test_sign_flip_sends_minus_scale_times_the_gradient():
    params = gradients()
    honest = flat([p.grad for p in params]).clone()
    assert Attack("sign-flip", 1000).before_step(params, 8) == 8
    torch.testing.assert_close(flat([p.grad for p in params]), -1000 * honest)


def test_random_direction_has_scale_times_the_honest_norm_and_a_new_direction_each_time():
    params = gradients()
    honest = flat([p.grad for p in params]).clone()
    attack = Attack("random-direction", 1000)
    attack.before_step(params, 8)
    first = flat([p.grad for p in params]).clone()
    torch.testing.assert_close(first.norm(), 1000 * honest.norm())
    cosine = torch.nn.functional.cosine_similarity(first, honest, dim=0)
    assert abs(cosine) < 0.9  # not the honest direction (22 dimensions: almost surely far from it)
    for p, g in zip(params, gradients(), strict=True):
        p.grad = g.grad
    attack.before_step(params, 8)
    assert not torch.allclose(flat([p.grad for p in params]), first)


def test_stale_keeps_sending_its_first_gradient():
    attack = Attack("stale")
    params = gradients(seed=0)
    first = flat([p.grad for p in params]).clone()
    attack.before_step(params, 8)
    for later in (1, 2, 3):
        params = gradients(seed=later)
        attack.before_step(params, 8)
        torch.testing.assert_close(flat([p.grad for p in params]), first)


def test_constant_and_nan_replace_every_value():
    params = gradients()
    Attack("constant", 1000).before_step(params, 8)
    assert (flat([p.grad for p in params]) == 1000).all()
    params = gradients()
    Attack("nan").before_step(params, 8)
    sent = flat([p.grad for p in params])
    assert torch.isnan(sent).any() and torch.isinf(sent).any() and not torch.isfinite(sent).any()


def test_inflated_progress_reports_scale_times_the_samples_with_an_honest_gradient():
    params = gradients()
    honest = flat([p.grad for p in params]).clone()
    assert Attack("inflate-progress", 1000).before_step(params, 8) == 8000
    assert torch.equal(flat([p.grad for p in params]), honest)


@pytest.mark.parametrize("name", ["label-shuffle", "silent"])
def test_attacks_that_act_elsewhere_leave_the_step_alone(name):
    params = gradients()
    honest = flat([p.grad for p in params]).clone()
    assert Attack(name).before_step(params, 8) == 8
    assert torch.equal(flat([p.grad for p in params]), honest)


def test_with_diloco_the_gradient_is_left_alone_and_the_pseudo_gradient_is_attacked():
    attack = Attack("sign-flip", 1000, on_gradients=False)
    params = gradients()
    honest = flat([p.grad for p in params]).clone()
    assert attack.before_step(params, 8) == 8
    assert torch.equal(flat([p.grad for p in params]), honest)  # the inner optimizer steps honestly
    own = [p.grad.clone() for p in params]
    sent = attack.pseudo_gradient(own)
    torch.testing.assert_close(flat(sent), -1000 * honest)
    torch.testing.assert_close(flat(own), honest)  # the peer's own change is not touched
    # inflated progress with diloco: the samples of each inner step (its round's weight and progress)
    assert Attack("inflate-progress", 10, on_gradients=False).before_step(params, 8) == 80


def test_the_attack_comes_from_the_environment(monkeypatch, caplog):
    monkeypatch.delenv(ATTACK, raising=False)
    assert Attack.from_env().name == ""
    monkeypatch.setenv(ATTACK, "sign-flip")
    monkeypatch.setenv(ATTACK_SCALE, "50")
    with caplog.at_level("WARNING", logger="cotrain.faults"):
        attack = Attack.from_env("sync")
        Attack.from_env("diloco", announce=False)
    assert (attack.name, attack.scale, attack.on_gradients) == ("sign-flip", 50.0, True)
    assert [r.getMessage() for r in caplog.records] == [
        "Fault injection: this peer attacks the swarm (COTRAIN_ATTACK=sign-flip, scale 50, strategy sync)"
    ]
    assert Attack.from_env("diloco", announce=False).on_gradients is False
    monkeypatch.setenv(ATTACK, "sign-flop")
    with pytest.raises(ValueError, match="the attacks are sign-flip"):
        Attack.from_env()
    with pytest.raises(ValueError, match="positive"):
        Attack("constant", 0)


def test_shuffled_labels_map_every_label_token_alike_and_flip_the_sentence_order(monkeypatch):
    labels = torch.tensor([[5, -100, 7, 5], [-100, 9, 5, -100]])
    batch = {
        "input_ids": torch.arange(8).reshape(2, 4),
        "labels": labels.clone(),
        "sentence_order_label": torch.tensor([0, 1]),
    }
    monkeypatch.setenv(ATTACK, "label-shuffle")
    out = next(attack_batches(iter([batch]), vocab_size=12))
    permutation = torch.randperm(12, generator=torch.Generator().manual_seed(faults.LABEL_SEED))
    assert torch.equal(out["labels"], shuffle_labels(batch, permutation)["labels"])
    ignored = labels == -100
    assert (out["labels"][ignored] == -100).all()
    assert torch.equal(out["labels"][~ignored], permutation[labels[~ignored]])
    assert len(set(out["labels"][labels == 5].tolist())) == 1  # one token, one wrong label
    assert (out["labels"][~ignored] != labels[~ignored]).any()
    assert out["sentence_order_label"].tolist() == [1, 0]
    assert torch.equal(out["input_ids"], batch["input_ids"]) and torch.equal(batch["labels"], labels)
    stream = iter([batch])
    monkeypatch.setenv(ATTACK, "sign-flip")
    assert attack_batches(stream, vocab_size=12) is stream  # other attacks: the trainer's own batches


def test_a_silent_member_waits_out_the_all_reduce_and_fails_it_for_itself(monkeypatch):
    from hivemind.averaging.partition import AllreduceException

    async def main(timeout):
        future = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        try:
            await silent_allreduce(future, timeout)
            return None, future, time.monotonic() - started
        except AllreduceException as e:
            return e, future, time.monotonic() - started

    monkeypatch.delenv(ATTACK, raising=False)
    error, future, _ = asyncio.run(main(5.0))
    assert error is None and not future.done()
    monkeypatch.setenv(ATTACK, "silent")
    error, future, seconds = asyncio.run(main(2.0))
    assert isinstance(error, AllreduceException) and future.cancelled() and seconds >= 0.9
