"""Signed metrics records.

Here, in the test process alone; the rest in tests/swarm/test_records.py."""

import math

import pytest

from cotrain.net.metrics import MAX_LOSS, LocalMetrics, reported_loss
from cotrain.roles.monitor import aggregate
from support.records import good


@pytest.mark.parametrize(
    "bad",
    [
        {"loss": -1.0},
        {"loss": math.nan},
        {"loss": math.inf},
        {"samples_per_second": 1e12},
        {"step": -1},
        {"samples_accumulated": "many"},
        {"group_size": 0},
        {"samples_per_second": math.nan},
    ],
)
def test_out_of_schema_values_are_refused(bad):
    with pytest.raises(ValueError):
        LocalMetrics(**{**good(), **bad})


@pytest.mark.parametrize("total", [3e9, math.inf, math.nan])
def test_a_diverged_trainers_loss_is_published_as_the_bound(total):
    assert LocalMetrics(**{**good(), "loss": reported_loss(total)}).loss == MAX_LOSS


def test_aggregate_follows_the_seed_recipe():
    records = {
        b"a": LocalMetrics(**good(loss=16.0, mini_steps=8)),
        b"b": LocalMetrics(**good(loss=8.0, mini_steps=8)),
    }
    line = aggregate(3, records)
    assert line["loss"] == pytest.approx(1.5) and line["alive_peers"] == 2 and line["samples"] == 128
    assert line["max_group_size"] == 2
