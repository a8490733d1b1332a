"""Helpers the test_records tests share across suites."""

from cotrain.net.metrics import LocalMetrics


def good(**kw) -> dict:
    fields = dict(
        step=3, samples_per_second=10.0, samples_accumulated=64, loss=20.0, mini_steps=8, group_size=2
    )
    return LocalMetrics(**{**fields, **kw}).dict()
