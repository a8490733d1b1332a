"""The convergence benchmark's curves: a swarm's sample-weighted loss, a run's final loss over a window."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import convergence  # noqa: E402


def test_swarm_curve_weights_each_trainers_loss_by_the_samples_it_contributed():
    a = [{"step": 1, "loss": 9.0, "contribution": 48}, {"step": 2, "loss": 8.0, "contribution": 80}]
    b = [{"step": 1, "loss": 7.0, "contribution": 16}, {"step": 2, "loss": 6.0, "contribution": 48}]
    curve = convergence.swarm_curve([a, b])
    assert curve[0] == (1, 64, pytest.approx((9.0 * 48 + 7.0 * 16) / 64))
    assert curve[1] == (2, 128, pytest.approx((8.0 * 32 + 6.0 * 32) / 64))


def test_final_loss_interpolates_the_curve_over_the_sample_window():
    curve = [(1, 64, 10.0), (2, 128, 8.0), (3, 192, 6.0)]
    assert convergence.final_loss(curve, 128, 192) == pytest.approx(7.0)
    assert math.isnan(convergence.final_loss(curve, 128, 256))  # the run did not reach the window
