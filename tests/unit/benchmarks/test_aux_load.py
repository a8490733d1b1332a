"""The auxiliary reducer's benchmark: a round's bytes at the reducers and the time the trainers waited."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import aux_load  # noqa: E402


def test_the_aux_load_benchmark_reads_a_round_s_bytes_at_the_reducers():
    class Counters:  # host 0 the reducer, hosts 1 and 2 its clients: (sent, received) over the window
        def between(self, t0, t1):
            assert (t0, t1) == (10.0, 32.0)
            return [(80e6, 78e6), (40e6, 41e6), (39e6, 40e6)]

    def mark(t, compute, on_device, in_step, failed):
        return {"t": t, "compute": compute, "on_device": on_device, "in_step": in_step, "rounds": [3, failed],
                "round_bytes": 35e6}  # fmt: skip

    marks = {
        1: {1: mark(10.0, 5, 1, 3, 0), 3: mark(30.0, 15, 3, 23, 0)},
        2: {1: mark(11.0, 5, 1, 3, 0), 3: mark(32.0, 15, 3, 27, 1)},
    }
    got = aux_load.summarize("diloco", marks, Counters(), [0], (1, 3), 100.0, [[2, 0]])
    assert (got["clients"], got["reducers"], got["seconds_per_round"]) == (2, 1, 11.0)
    assert got["compute_per_round"] == 6.0 and got["waited_per_round"] == 10.0  # (20 + 24) / 4 - 1
    assert (got["reducer_received_per_round"], got["reducer_sent_per_round"]) == (39e6, 40e6)
    assert got["client_sent_per_round"] == 19.75e6 and got["failed_rounds"] == 1
    assert got["bound_s"] == pytest.approx(2 * 35e6 / 12.5e6)  # 2 vectors through one 100 Mbit/s link
