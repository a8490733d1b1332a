"""Pure helpers of the network benchmarks: the all-reduce bound, namespace names, convergence curves."""

from __future__ import annotations

import math
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import _netns  # noqa: E402
import convergence  # noqa: E402


def test_allreduce_bound_is_twice_n_minus_one_over_n_messages_at_link_rate():
    fp16 = 17_847_474 * 2  # ALBERT-large's gradients in fp16, bytes
    assert _netns.allreduce_bound_s(2, fp16, 100e6) == pytest.approx(fp16 * 8 / 100e6)  # 2.856 s
    assert _netns.allreduce_bound_s(4, fp16, 100e6) == pytest.approx(1.5 * fp16 * 8 / 100e6)
    assert _netns.allreduce_bound_s(8, fp16, 50e6) == pytest.approx(1.75 * fp16 * 8 / 50e6)
    assert _netns.allreduce_bound_s(1, fp16, 100e6) == 0.0  # nothing to exchange alone


@pytest.mark.parametrize("name", ["cotrain-bench-123-h0", "cotrain-bench-123-br", "a", "x_y.z-1"])
def test_namespace_names_that_ip_netns_stores_as_plain_files_are_accepted(name):
    assert _netns.valid_netns_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "../etc", "a/b", "-x", "has space", "x" * 64, "ns\n"])
def test_namespace_names_with_paths_or_odd_characters_are_refused(name):
    assert not _netns.valid_netns_name(name)


def test_only_this_benchmarks_own_namespaces_count_as_stale_candidates():
    assert _netns._OURS.match(f"{_netns.PREFIX}-4242-h3").group(1) == "4242"
    assert _netns._OURS.match("cotrain-part-4242-h3") is None  # another program's namespaces are left alone
    assert _netns._OURS.match("netns0") is None


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
