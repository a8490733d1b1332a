"""Fault injection of malicious peers (cotrain.faults, COTRAIN_ATTACK): what each attack does to what a peer
sends, and that each hook sits where the attack must act: the sync strategy's gradient after the engine's
clipping and finiteness check, DiLoCo's pseudo-gradient in the outer all-reduce, the reported samples, the
trainer's labels, and a silent member inside a real all-reduce."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import cotrain_env
from cotrain import faults
from cotrain.faults import ATTACK, ATTACK_SCALE, Attack, attack_batches, shuffle_labels, silent_allreduce

# --- what each attack does -------------------------------------------------------------------------------


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


# --- label-shuffle --------------------------------------------------------------------------------------


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


# --- silent ---------------------------------------------------------------------------------------------


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


def make_averagers(tensors: list[list[torch.Tensor]], silent: int, monkeypatch):
    """One averager with cotrain's robust reducers (in its own process) per entry of ``tensors``; the one
    at index ``silent`` starts with COTRAIN_ATTACK=silent in its environment."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    from cotrain.hivemind_ext.reducers import RobustAveraging

    class Averager(RobustAveraging, DecentralizedAverager):
        pass

    local = ["/ip4/127.0.0.1/tcp/0"]
    first = hivemind.DHT(start=True, host_maddrs=local)
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=local, initial_peers=first.get_visible_maddrs())
        for _ in tensors[1:]
    ]
    made = []
    for i, (own, dht) in enumerate(zip(tensors, dhts, strict=True)):
        if i == silent:  # the averager's process takes the environment it starts with
            monkeypatch.setenv(ATTACK, "silent")
        else:
            monkeypatch.delenv(ATTACK, raising=False)
        made.append(
            Averager(
                [t.clone() for t in own],
                dht,
                prefix="silent-test",
                target_group_size=len(tensors),
                min_matchmaking_time=4.0,
                request_timeout=2.0,
                next_chunk_timeout=3.0,
                allreduce_timeout=20.0,
                part_size_bytes=PART_BYTES,
                start=True,
            )
        )
    monkeypatch.delenv(ATTACK, raising=False)
    return made, dhts


# 250 values a part, 12 parts of 3,000 values, 3 for each reducer: with one part (hivemind's default size) the
# whole vector goes to one reducer, the silent member in one group of four
PART_BYTES = 1000


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_silent_member_joins_the_group_and_contributes_nothing(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(3000, generator=gen)] for _ in range(3)]
    tensors.append([torch.full((3000,), 1e6)])  # the silent member: any of its values would show
    made, dhts = make_averagers(tensors, silent=3, monkeypatch=monkeypatch)
    try:
        # 30 s: matchmaking (4 s) and the all-reduce (its 20 s timeout) fit; the silent member, its round
        # failed after 19 s, looks for another group until then
        controls = [a.step(wait=False, timeout=30) for a in made]
        outcomes = []
        for c in controls:
            try:
                outcomes.append(len(c.result(90)))
            except Exception as e:
                outcomes.append(e)
        out = []
        for a in made:
            with a.get_tensors() as ts:
                out.append(ts[0].clone())
    finally:
        for a in made:
            a.shutdown()
        for d in dhts:
            d.shutdown()
    assert outcomes[:3] == [4, 4, 4], outcomes  # it was in their group ...
    assert isinstance(outcomes[3], BaseException), outcomes  # ... and failed the round for itself alone
    mean = sum(t[0] for t in tensors[:3]) / 3
    for own, got in zip(tensors[:3], out[:3], strict=True):
        # every value is the honest mean (parts reduced by honest peers) or the peer's own value (the part
        # the silent member should have reduced): nothing of the silent member's got in
        averaged = (got - mean).abs() < 1e-4
        kept = (got - own[0]).abs() < 1e-6
        assert (averaged | kept).all()
        assert averaged.float().mean() == pytest.approx(0.75)  # the 3 honest reducers' parts were averaged


# --- the hooks in a real peer ----------------------------------------------------------------------------

PEER_SCRIPT = r"""
import json, sys, torch, cotrain
strategy = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
peer = cotrain.SwarmPeer(
    model,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    run_id="attack-hooks",
    target_batch_size=10**6,
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    max_grad_norm=1.0,
    torch_threads=1,
    startup_timeout=30.0,
    strategy=strategy,
    local_steps=1,
)
with peer:
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():  # a gradient of norm 2 x sqrt(36) = 12, clipped to 1 by the engine
        p.grad = torch.full_like(p, 2.0)
    peer.step(batch_size=4)
    opt = peer.strategy.opt
    moved = [(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)]
    out = {"moved": torch.cat(moved).tolist()}
    if strategy == "sync":
        out["sent"] = torch.cat([t.reshape(-1) for t in opt.grad_averager._grad_accumulators()]).tolist()
        out["weight"] = opt.grad_averager.local_samples_accumulated
    else:
        own = opt._own_change()
        sent, _ = opt._payload(own)  # what this round sends: where the attack applies
        control = opt._launch(sent, opt.samples)
        with opt.outer_averager.get_tensors() as tensors:
            out["sent"] = torch.cat([t.reshape(-1) for t in tensors[: len(own)]]).tolist()
        control.cancel()
        out["own"] = torch.cat([t.reshape(-1) for t in own]).tolist()
        out["weight"] = opt.samples
    out["progress"] = opt.tracker.local_progress.samples_accumulated
    print("RESULT " + json.dumps(out), flush=True)
"""


def run_peers(cases: list[tuple[str, str]]) -> list[dict]:
    """PEER_SCRIPT once per (strategy, attack), in processes of their own at the same time."""
    procs = []
    for strategy, attack in cases:
        env = {**cotrain_env(), ATTACK: attack}
        env.pop(ATTACK_SCALE, None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PEER_SCRIPT, strategy],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
        )
    results = []
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=150)
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, text[-3000:]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return results


CLIPPED = 2.0 / 12.0  # each value of the clipped gradient


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_sync_strategy_sends_the_attacked_gradient_past_the_engines_checks():
    honest, flipped, nan, inflated = run_peers(
        [("sync", ""), ("sync", "sign-flip"), ("sync", "nan"), ("sync", "inflate-progress")]
    )
    torch.testing.assert_close(torch.tensor(honest["sent"]), torch.full((36,), CLIPPED))
    assert honest["weight"] == honest["progress"] == 4
    # clipped first (the engine's clipping), then flipped: what the all-reduce would carry
    torch.testing.assert_close(torch.tensor(flipped["sent"]), torch.full((36,), -1000 * CLIPPED))
    # NaN/Inf after the finiteness check: not dropped, on the wire
    assert not torch.isfinite(torch.tensor(nan["sent"])).any()
    torch.testing.assert_close(torch.tensor(inflated["sent"]), torch.full((36,), CLIPPED))
    assert inflated["weight"] == inflated["progress"] == 4000


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_diloco_sends_the_attacked_pseudo_gradient_and_steps_honestly_itself():
    honest, flipped, inflated = run_peers(
        [("diloco", ""), ("diloco", "sign-flip"), ("diloco", "inflate-progress")]
    )
    for peer in (honest, flipped, inflated):
        # the inner SGD step (lr 0.1) on the clipped, honest gradient
        torch.testing.assert_close(torch.tensor(peer["moved"]), torch.full((36,), -0.1 * CLIPPED))
        torch.testing.assert_close(torch.tensor(peer["own"]), torch.full((36,), 0.1 * CLIPPED))
    torch.testing.assert_close(torch.tensor(honest["sent"]), torch.tensor(honest["own"]))
    torch.testing.assert_close(torch.tensor(flipped["sent"]), -1000 * torch.tensor(flipped["own"]))
    assert honest["weight"] == honest["progress"] == 4
    assert inflated["weight"] == inflated["progress"] == 4000
