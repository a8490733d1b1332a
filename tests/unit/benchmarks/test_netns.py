"""The namespaced hosts' helpers (benchmarks/lib/netns.py): the all-reduce bound, the names of namespaces, and
which namespaces a run may remove as stale."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from lib import netns  # noqa: E402


def test_allreduce_bound_is_twice_n_minus_one_over_n_messages_at_link_rate():
    fp16 = 17_847_474 * 2  # ALBERT-large's gradients in fp16, bytes
    assert netns.allreduce_bound_s(2, fp16, 100e6) == pytest.approx(fp16 * 8 / 100e6)  # 2.856 s
    assert netns.allreduce_bound_s(4, fp16, 100e6) == pytest.approx(1.5 * fp16 * 8 / 100e6)
    assert netns.allreduce_bound_s(8, fp16, 50e6) == pytest.approx(1.75 * fp16 * 8 / 50e6)
    assert netns.allreduce_bound_s(1, fp16, 100e6) == 0.0  # nothing to exchange alone


@pytest.mark.parametrize("name", ["cotrain-bench-123-h0", "cotrain-bench-123-br", "a", "x_y.z-1"])
def test_namespace_names_that_ip_netns_stores_as_plain_files_are_accepted(name):
    assert netns.valid_netns_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "../etc", "a/b", "-x", "has space", "x" * 64, "ns\n"])
def test_namespace_names_with_paths_or_odd_characters_are_refused(name):
    assert not netns.valid_netns_name(name)


def test_only_this_benchmarks_own_namespaces_count_as_stale_candidates():
    assert netns._OURS.match(f"{netns.PREFIX}-4242-h3").group(1) == "4242"
    assert netns._OURS.match("cotrain-part-4242-h3") is None  # another program's namespaces are left alone
    assert netns._OURS.match("netns0") is None
