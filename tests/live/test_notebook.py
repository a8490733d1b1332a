"""notebooks/join.ipynb, executed headless with nbclient in this virtual environment's kernel against a live
swarm on 127.0.0.1 (a monitor and one trainer on the CPU).

Here, with cotrain processes; the rest in tests/unit/test_notebook.py."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    cotrain_env,
    monitor_address,
    monitor_args,
    read_rows,
    trainer_args,
    trainer_rows,
)
from support.notebook import NOTEBOOK, nbformat

nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (the dev extra)")


SLOWER_STEPS = ["--target-batch-size", "128"]  # global steps of a few seconds, not one


RUN = "notebook-test"


MAX_STEPS = 10  # the global step at which the notebook's trainer stops


def set_parameters(cell, values: dict) -> None:
    """Replace the value of each ``NAME = ...`` line of the parameters cell (every name must be there)."""
    lines = cell.source.splitlines()
    for name, value in values.items():
        found = [i for i, line in enumerate(lines) if re.match(rf"{name} = ", line)]
        assert len(found) == 1, f"the parameters cell has no single {name} line"
        lines[found[0]] = f"{name} = {value!r}"
    cell.source = "\n".join(lines)


def cell_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


@pytest.fixture(scope="module")
def swarm(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("notebook")
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST, *SLOWER_STEPS]
    roles: dict[str, Role] = {}
    try:
        roles["monitor"] = Role(monitor_args(common, out / "monitor"), out / "monitor.log")
        initial = monitor_address(out / "monitor", 240)
        roles["trainer"] = Role(
            trainer_args(common, initial, demo_data, 1, out / "trainer", "--statistics-expiration", "60"),
            out / "trainer.log",
        )
        yield {"out": out, "initial": initial, "data": demo_data, "roles": roles}
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_notebook_joins_the_swarm_and_averages(swarm, tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    prefix = tmp_path / "jupyter"  # a kernel of this virtual environment, whatever else is installed
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--prefix", str(prefix), "--name", "cotrain-test"],
        check=True,
        capture_output=True,
    )
    specs = KernelSpecManager(kernel_dirs=[str(prefix / "share" / "jupyter" / "kernels")])
    metrics = swarm["out"] / "monitor" / "metrics.jsonl"
    # the kernel starts while the swarm's trainer does (a lone step takes seconds): room to join and average
    max_steps = MAX_STEPS

    nb = nbformat.read(NOTEBOOK, as_version=4)
    default_extra = re.search(r'^EXTRA_ARGS = "(.*)"$', nb.cells[0].source, flags=re.M).group(1)
    set_parameters(
        nb.cells[0],
        {
            "INITIAL_PEERS": " ".join(swarm["initial"]),
            "RUN_ID": RUN,
            "PRESET": "albert-tiny",
            "DATASET": str(swarm["data"]),
            "INSTALL": "",
            "MICRO_BATCH": 8,
            "MAX_STEPS": max_steps,
            "TIME_LIMIT_MINUTES": 9.0,
            "REQUIRE_GPU": False,
            "SEED": 7,
            # the notebook's own default first: it must suit a small preset's target batch
            "EXTRA_ARGS": " ".join([default_extra, *FAST, *SLOWER_STEPS, "--statistics-expiration", "60"]),
        },
    )
    work = tmp_path / "work"
    work.mkdir()
    client = nbclient.NotebookClient(
        nb,
        km=AsyncKernelManager(kernel_name="cotrain-test", kernel_spec_manager=specs),
        timeout=600,
        resources={"metadata": {"path": str(work)}},
    )
    try:
        client.execute(env=cotrain_env())
    finally:
        (tmp_path / "executed.ipynb").write_text(nbformat.writes(nb))  # for a look after a failure
    texts = [cell_text(c) for c in nb.cells if c.cell_type == "code"]
    assert any("Running on CPU, micro-batch 8" in t for t in texts), texts
    assert any("open files limit:" in t for t in texts), texts
    train = texts[-1]
    assert "--client-mode" in train and f"Reached --max-steps {max_steps}" in train, train[-3000:]
    assert re.search(r"\] step \d+ \| loss ", train), train[-3000:]  # the notebook shows each step's line
    assert "--overwrite-output-dir" not in train  # run again, it resumes from its local checkpoints
    steps = trainer_rows(work / "outputs")  # the notebook's OUTPUT_DIR
    rows = [r for r in steps if r["group_size"] == 2]
    assert rows, train[-3000:]
    # each global step took the swarm's target batch (128, about half from each trainer), not one micro-batch
    per_step = (steps[-1]["contribution"] - steps[0]["contribution"]) / (steps[-1]["step"] - steps[0]["step"])
    assert per_step >= int(SLOWER_STEPS[1]) / 4, steps
    assert "Left the swarm" in train and "Traceback" not in train
    assert (work / "outputs").is_dir()  # the notebook's OUTPUT_DIR, relative to where it runs
    assert any(r["client_peers"] >= 1 and r["alive_peers"] == 2 for r in read_rows(metrics))
