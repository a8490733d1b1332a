"""Integrity of the swarm's records and of its training.

Here, in the test process alone; the rest in tests/live/test_integrity.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cotrain.engine import gradient_norm
from cotrain.net.configrecord import (
    ConfigMismatch,
    ConfigRecord,
    check_agreement,
    make_record,
    swarm_record,
    text_hash,
)
from cotrain.net.metrics import LocalMetrics
from cotrain.roles.monitor import MAX_STEPS_AHEAD, aggregate, plausible
from support.integrity import RUN, metrics, run_config


@pytest.mark.parametrize(
    "bad",
    [
        {"loss": math.nan},
        {"loss": -5.0},
        {"loss": math.inf},
        {"samples_per_second": 1e12},
        {"samples_per_second": math.nan},
        {"samples_accumulated": -64},
        {"step": -1},
        {"step": 10**6},  # within the schema, but far ahead of every other peer
        {"mini_steps": "many"},
    ],
)
def test_aggregate_ignores_an_implausible_record_however_it_arrived(bad):
    honest = {b"a": metrics(loss=16.0), b"b": metrics(loss=8.0, samples_per_second=5.0)}
    # construct() skips validation: a record that got past the DHT's validators somehow
    forged = LocalMetrics.construct(**{**metrics().dict(), **bad})
    for extra in (forged, {**metrics().dict(), **bad}):
        line = aggregate(3, {**honest, b"forger": extra})
        expected = aggregate(3, honest)
        assert {k: v for k, v in line.items() if k != "time"} == {
            k: v for k, v in expected.items() if k != "time"
        }
        assert (
            line["loss"] == pytest.approx(1.5)
            and line["alive_peers"] == 2
            and line["samples_per_second"] == 15
        )
    assert set(plausible({**honest, b"forger": forged})) == {b"a", b"b"}


def test_steps_ahead_are_judged_against_the_other_peers():
    near = metrics(step=3 + MAX_STEPS_AHEAD)
    far = metrics(step=4 + MAX_STEPS_AHEAD)
    assert set(plausible({b"a": metrics(), b"n": near})) == {b"a", b"n"}
    assert set(plausible({b"a": metrics(), b"b": metrics(), b"f": far})) == {b"a", b"b"}
    assert set(plausible({b"alone": far})) == {b"alone"}  # nothing to compare a lone peer with


@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_gradient_norm_sees_nan_and_inf(max_norm):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model(torch.randn(5, 4)).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert gradient_norm(list(model.parameters()), max_norm) == pytest.approx(expected, rel=1e-5)
    for poison in (math.nan, math.inf):
        model[1].bias.grad[0] = poison
        assert not math.isfinite(gradient_norm(list(model.parameters()), max_norm))


def test_a_config_record_must_match_its_hash():
    record = make_record(run_config(), "trainer")
    assert record.hash == text_hash(record.config)
    with pytest.raises(ValueError, match="hash does not match"):
        ConfigRecord(**{**record.dict(), "config": record.config.replace("0.02", "0.2")})


def test_a_loop_of_ones_own_agrees_on_its_settings_alone_and_leaves_whole_configs_to_the_others():
    """An API peer (cotrain.SwarmPeer) compares and publishes the run settings it takes (API_RUN); the
    monitor's whole config holds a model of its own, which the API peer's loop does not train. A trainer
    compares with whole configs only, and never takes an API peer's record as the swarm's run."""
    from cotrain.engine.settings import API_RUN, configs_of
    from cotrain.net.configrecord import API_ROLE, projected

    names = tuple(API_RUN)

    def api(**settings) -> ConfigRecord:
        run, _, _ = configs_of({"run_id": RUN, "target_batch_size": 64, **settings}, None)
        return make_record(projected(dataclasses.asdict(run), names), API_ROLE)

    monitor = {b"monitor": make_record(run_config(learning_rate=0.05), "monitor")}
    check_agreement(monitor, api(), RUN, b"me", names=names)  # the model and its optimizer are the loop's own
    with pytest.raises(ConfigMismatch, match="target_batch_size 4096 != 64") as refused:
        check_agreement(monitor, api(target_batch_size=4096), RUN, b"me", names=names)
    assert "learning_rate" not in str(refused.value)
    with pytest.raises(ConfigMismatch, match='strategy "diloco" != "sync"'):
        check_agreement(monitor, api(strategy="diloco"), RUN, b"me", names=names)
    # API peers agree with each other on their settings; two of them outvote a monitor there
    loops = {bytes([i]): api(strategy="diloco") for i in range(2)}
    check_agreement({**monitor, **loops}, api(strategy="diloco"), RUN, b"me", names=names)
    # a trainer sees the monitor's whole config, never the API peers' part of one
    assert swarm_record({**monitor, **loops})[0].role == "monitor"
    assert swarm_record(loops) is None
    check_agreement(loops, make_record(run_config(), "trainer"), RUN, b"me")
