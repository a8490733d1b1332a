"""cotrain.host.deferred.

Here, with cotrain processes; the rest in tests/unit/host/test_deferred.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

IN_A_FRESH_PROCESS = """
import json, sys, threading
from cotrain._worker import main  # noqa: F401  (what a role process imports first)
from cotrain.host.deferred import StandIn, defer_all
deferred = defer_all()
import hivemind
from hivemind.averaging.load_balancing import load_balance_peers
before = {
    "deferred": deferred,
    "stand_in": isinstance(sys.modules["scipy.optimize"], StandIn),
    "loaded": sorted(m for m in sys.modules if m.startswith("scipy.optimize.")),
    "probe": hasattr(sys.modules["scipy.optimize"], "__file__"),
}
# no bandwidths given: the parts are sized without a linear program, so nothing is loaded
even = load_balance_peers(1000, [None, None, None])
before["loaded_after_even"] = sorted(m for m in sys.modules if m.startswith("scipy.optimize."))
results, start = [], threading.Barrier(4)
def balance():
    start.wait()
    results.append(load_balance_peers(100000, [100.0, 20.0, None, 50.0]))
threads = [threading.Thread(target=balance) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({**before, "even": even, "results": results,
                  "real": type(sys.modules["scipy.optimize"]).__name__,
                  "on_parent": type(sys.modules["scipy"].optimize).__name__}))
"""


def test_hivemind_loads_scipy_optimize_only_for_a_linear_program_and_from_many_threads_at_once():
    done = subprocess.run(
        [sys.executable, "-c", IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["deferred"] == ["scipy.optimize"]
    assert seen["stand_in"] and seen["loaded"] == [] and seen["probe"] is False
    assert seen["loaded_after_even"] == [] and sum(seen["even"]) == 1000

    from hivemind.averaging.load_balancing import (
        load_balance_peers,  # here scipy.optimize is imported as usual
    )

    expected = list(load_balance_peers(100000, [100.0, 20.0, None, 50.0]))
    assert seen["results"] == [expected] * 4
    assert seen["real"] == "module" and seen["on_parent"] == "module"


MODEL_CODE_IN_A_FRESH_PROCESS = """
import json, sys
from cotrain._worker import main
from cotrain.host.deferred import StandIn, defer_all
defer_all()
import transformers.loss.loss_utils  # what transformers' model classes import: its detection losses
from cotrain import config
from cotrain.models import build_model
build_model(config.resolve("albert-tiny").run, vocab_size=100)
seen = {"stand_in": isinstance(sys.modules["scipy.optimize"], StandIn),
        "loaded": sorted(m for m in sys.modules if m.startswith("scipy.optimize."))}
from scipy.optimize import linear_sum_assignment
rows, cols = linear_sum_assignment([[4, 1, 3], [2, 0, 5], [3, 2, 2]])
seen.update(name=linear_sum_assignment.__name__, rows=rows.tolist(), cols=cols.tolist(),
            real=type(sys.modules["scipy.optimize"]).__name__)
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_transformers_model_code_leaves_scipy_optimize_unloaded_until_its_function_is_called():
    done = subprocess.run(
        [sys.executable, "-c", MODEL_CODE_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["stand_in"] and seen["loaded"] == []
    # scipy's own answer for this cost matrix (its documentation's example): rows 0,1,2 -> columns 1,0,2
    assert seen["name"] == "linear_sum_assignment"
    assert (seen["rows"], seen["cols"]) == ([0, 1, 2], [1, 0, 2])
    assert seen["real"] == "module"
