"""Helpers the test_integrity tests share across suites."""

from __future__ import annotations

import dataclasses

from cotrain.config import resolve
from cotrain.net.metrics import LocalMetrics

RUN = "integrity-test"


def metrics(**kw) -> LocalMetrics:
    fields = dict(
        step=3, samples_per_second=10.0, samples_accumulated=64, loss=16.0, mini_steps=8, group_size=2
    )
    return LocalMetrics(**{**fields, **kw})


def run_config(**overrides) -> dict:
    """The swarm-wide settings of a run, as a peer publishes them."""
    return dataclasses.asdict(
        resolve(overrides={"run": {"preset": "albert-tiny", "run_id": RUN, **overrides}}).run
    )
