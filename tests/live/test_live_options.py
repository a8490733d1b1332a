"""Options that need a real swarm: the original command lines started for real, a trainer whose parameters
turn to NaN restoring its backup and training on, a bf16 trainer averaging with a peer, the relay switch
reaching p2pd, and optimizer statistics downloaded from a peer bit for bit.

One swarm serves the first tests: a monitor and a trainer started from the seed documents' command lines (with
`cotrain monitor`/`cotrain train` in place of the scripts, the addresses and paths made local) and a second
trainer in bf16 with an automatic micro-batch.
"""

from __future__ import annotations

import math
import re

import psutil
import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    check_announced,
    events,
    monitor_address,
    monitor_args,
    read_rows,
    saw_peers,
    trainer_rows,
    wait_until,
)
from support.seeds import PEER, seed_commands

pytestmark = [pytest.mark.slow]


RUN = "seed-lines"


CORRUPT_AT = 3


STEPS = 6


def seed_line(role: str, *flags: str) -> list[str]:
    """The first command line of ``role`` in the seed documents that has all ``flags`` and no --client_mode
    (002, the tutorial: its monitor and its trainer), as `cotrain ROLE ARGS`."""
    for found_role, args, _ in seed_commands():
        if found_role == role and all(f in args for f in flags) and "--client_mode" not in args:
            return [role, *args]
    raise AssertionError(f"no {role} line with {flags} in the seed documents")


def localized(args: list[str], replacements: dict[str, str]) -> list[str]:
    return [replacements.get(a, a) for a in args]


class SeedRole(Role):
    """A role started from a seed command line: it listens where the line says (made 127.0.0.1 here), so the
    common helper's check for an explicit --host-maddrs is replaced by a check of the translated address."""

    @staticmethod
    def check_listen(args: list[str]) -> None:
        from cotrain import cli
        from cotrain.net.dht import parse_maddrs

        _, config = cli.parse(args)
        listen = parse_maddrs(config.peer.host_maddrs, "listen")
        assert listen and all(m.startswith("/ip4/127.0.0.1/") for m in listen), listen


def p2pd_args(role: Role) -> list[str]:
    for pid in role.tree():
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if cmd and cmd[0].endswith("p2pd"):
            return cmd
    return []


@pytest.mark.timeout(240)
def test_optimizer_statistics_download_bit_for_bit(tmp_path):
    """A peer loading state from another gets its LAMB second moments exactly, 1e-10 values included, and its
    parameters exactly; the optimizer is configured from the peer's options."""
    import torch

    from cotrain import config as cfg
    from cotrain.engine import SwarmConnection
    from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory
    from cotrain.strategies.sync import SyncStrategy

    config = cfg.resolve(
        "albert-tiny",
        overrides={
            "run": {"run_id": "exact-state"},
            "peer": {
                "matchmaking_time": 2.0,
                "averaging_timeout": 10.0,
                "host_maddrs": [LOCALHOST],
                "target_group_size": 3,
                "min_refresh_period": 0.25,
                "metadata_expiration": 45.0,
                "performance_ema_alpha": 0.3,
                "delay_grad_averaging": True,
                "load_state_timeout": 60.0,
                "startup_timeout": 60.0,
            },
        },
    )
    run, peer = config.run, config.peer
    made = []

    def peer_optimizer(initial: list[str], seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        connection = SwarmConnection(
            run.run_id, dataclasses_replace(peer, initial_peers=initial), role="test"
        )
        strategy = SyncStrategy(
            connection.dht,
            run,
            peer,
            parameter_groups(model, run.weight_decay),
            optimizer_factory(run),
            scheduler_factory(run),
            8,
            lambda: False,
        )
        made.append((strategy, connection))
        return model, strategy.opt, connection

    try:
        _, server, dht = peer_optimizer([], 0)
        inner = server.state_averager.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        with server.state_averager.lock_averaged_tensors:
            for p in params:
                p.grad = torch.randn_like(p)
            inner.step()  # LAMB creates its moments
            for p in params:
                inner.state[p]["exp_avg_sq"].copy_(torch.rand_like(p) * 1e-10)
        expected_sq = [inner.state[p]["exp_avg_sq"].clone() for p in params]
        expected_params = [p.detach().clone() for p in params]
        assert all(0 < t.max() < 1e-9 for t in expected_sq)

        _, joiner, _ = peer_optimizer(dht.maddrs(), 1)
        # the options reached hivemind
        assert joiner.grad_averager.matchmaking_kwargs["target_group_size"] == 3
        assert joiner.tracker.min_refresh_period == 0.25 and joiner.tracker.metadata_expiration == 45.0
        assert joiner.tracker.performance_ema.alpha == 0.3
        assert (
            joiner.delay_grad_averaging
            and joiner.delay_optimizer_step
            and joiner.state_averager.offload_optimizer
        )
        assert type(joiner.state_averager.state_compression).__name__ == "NoCompression"

        def loaded() -> bool:
            joiner.load_state_from_peers()
            got = [p for group in joiner.state_averager.optimizer.param_groups for p in group["params"]]
            state = joiner.state_averager.optimizer.state
            return all(p in state for p in got)

        wait_until(loaded, 120, interval=1.0, what="state downloaded from the first peer")
        got_params = [p for group in joiner.state_averager.optimizer.param_groups for p in group["params"]]
        got_sq = [joiner.state_averager.optimizer.state[p]["exp_avg_sq"] for p in got_params]
        assert all(torch.equal(a, b) for a, b in zip(got_sq, expected_sq, strict=True))
        assert all(torch.equal(a.detach(), b) for a, b in zip(got_params, expected_params, strict=True))
    finally:
        for strategy, connection in reversed(made):
            strategy.shutdown()
            connection.close()


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


@pytest.mark.timeout(240)
def test_a_trainer_stops_after_its_epochs(demo_data, tmp_path):
    """--num-train-epochs: a lone trainer (its optimizer on the device: --no-offload-optimizer) stops by
    itself after the asked fraction of a pass over its examples."""
    role = Role(
        [
            "train",
            "--preset",
            "albert-tiny",
            "--run-id",
            "epochs",
            "--host-maddrs",
            LOCALHOST,
            *FAST,
            "--dataset-path",
            str(demo_data),
            "--num-train-epochs",
            "0.05",
            "--no-offload-optimizer",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        tmp_path / "trainer.log",
    )
    try:
        rc = role.proc.wait(timeout=560)  # about 30 s on an idle machine
        text = role.text()
    finally:
        role.stop()
    assert rc == 0, text[-2000:]
    assert "Done 0.05 passes over this peer's data; stopping" in text and "Traceback" not in text


@pytest.fixture(scope="module")
def swarm(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("seedlines")
    tiny = ["--preset", "albert-tiny", *FAST]
    seed_monitor = localized(
        seed_line("monitor", "--dht_listen_on", "--experiment_prefix", "--wandb_project"),
        {"[::]:*": "127.0.0.1:*", "NAME_YOUR_EXPERIMENT": RUN, "WANDB_PROJECT_HERE": "seed-lines-offline"},
    )
    roles: dict[str, Role] = {}
    try:
        roles["monitor"] = SeedRole(
            monitor_args([*seed_monitor[1:], *tiny], out / "monitor"),  # [1:]: the line without its role
            out / "monitor.log",
            env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"},
        )
        initial = monitor_address(out / "monitor", 180)
        check_announced(initial)
        seed_trainer = localized(
            seed_line("train", "--experiment_prefix", "--logging_first_step", "--logging_dir"),
            {
                "SAME_AS_IN_RUN_TRAINING_MONITOR": RUN,
                PEER: initial[0],
                "./outputs": str(out / "seed-trainer"),
                "./logs": str(out / "seed-trainer-logs"),
            },
        )
        roles["seed"] = SeedRole(
            [
                *seed_trainer,
                *tiny,
                "--host_maddrs",
                LOCALHOST,
                "--dataset_path",
                str(demo_data),
                "--backup_every_steps",
                "2",
                "--statistics-expiration",
                "30",
            ],
            out / "seed-trainer.log",
            env={"COTRAIN_DEBUG_CORRUPT_PARAMS_AT_STEP": str(CORRUPT_AT)},
        )
        roles["bf16"] = Role(
            [
                "train",
                *tiny,
                "--run-id",
                RUN,
                "--initial-peers",
                *initial,
                "--host-maddrs",
                LOCALHOST,
                "--dataset-path",
                str(demo_data),
                "--seed",
                "7",
                "--bf16",
                "--per-device-train-batch-size",
                "auto",
                "--dataloader-num-workers",
                "1",
                "--no-use-relay",
                "--output-dir",
                str(out / "bf16"),
                "--statistics-expiration",
                "30",
            ],
            out / "bf16.log",
        )
        metrics = out / "monitor" / "metrics.jsonl"

        def done():
            rows = read_rows(metrics)
            seed_rows = read_rows(out / "seed-trainer" / "metrics.jsonl")
            bf16_rows = trainer_rows(roles["bf16"])
            # on a loaded machine the bf16 peer (slower per sample, and late: it probes its micro-batch first)
            # may take a few steps to catch up before it averages: wait until both averaged after the NaN
            return (
                rows
                and max(r["step"] for r in rows) >= STEPS
                and saw_peers(rows, 2)
                and any(r["step"] > CORRUPT_AT + 1 for r in seed_rows)
                and any(r["step"] > CORRUPT_AT and r["group_size"] == 2 for r in seed_rows)
                and len(bf16_rows) >= 3
                and any(r["group_size"] == 2 for r in bf16_rows)
            )

        wait_until(done, 600, interval=1.0, what=f"{STEPS} global steps")
        yield {"out": out, "roles": roles, "metrics": metrics, "initial": initial}
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.timeout(240)
def test_the_seed_command_lines_train_a_swarm(swarm):
    rows = [r for r in read_rows(swarm["metrics"]) if r["loss"] is not None]
    assert max(r["step"] for r in rows) >= STEPS and max(r["alive_peers"] for r in rows) == 2, rows
    monitor = swarm["roles"]["monitor"].text()
    assert f"Monitor of run {RUN!r} is up" in monitor
    seed = swarm["roles"]["seed"].text()
    assert "Traceback" not in seed and "Traceback" not in monitor
    # --logging_steps 100 with --logging_first_step: exactly the first global step is logged (the log a user
    # reads), while OUTPUT_DIR/metrics.jsonl holds every step
    first = trainer_rows(swarm["out"] / "seed-trainer")[0]["step"]
    logged = re.findall(r"\] step (\d+) \| loss ", seed)
    assert logged == [str(first)], (logged, first)
    # --logging_dir: TensorBoard event files of the logged step
    assert list((swarm["out"] / "seed-trainer-logs").glob("events.out.tfevents.*"))


def test_a_peer_with_nan_parameters_restores_its_backup_and_keeps_contributing(swarm):
    seed = swarm["roles"]["seed"].text()
    assert f"filled a parameter with NaN at global step {CORRUPT_AT}" in seed
    restored = [line for line in seed.splitlines() if "restored the backup of global step" in line]
    assert len(restored) == 1, seed[-3000:]
    backup_step = int(restored[0].rsplit(" ", 1)[1])
    rows = read_rows(swarm["out"] / "seed-trainer" / "metrics.jsonl")
    # --backup_every_steps 2: a backup at most 2 steps old, unless this peer caught up with the swarm by
    # loading its state in between (it then skipped the steps at which a backup was due: no row for them)
    seen = {r["step"] for r in rows}
    skipped = [s for s in range(backup_step + 1, CORRUPT_AT) if s not in seen]
    assert backup_step <= CORRUPT_AT and (backup_step >= CORRUPT_AT - 2 or skipped), (restored, sorted(seen))
    after = [r for r in rows if r["step"] > CORRUPT_AT]
    assert after and all(r["loss"] is not None and math.isfinite(r["loss"]) for r in after), rows
    assert any(r["group_size"] == 2 for r in after), after  # still averaging with its peer
    # the swarm's model stayed finite: the other trainer's losses and the monitor's aggregate
    other = trainer_rows(swarm["roles"]["bf16"])
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in other), other
    assert all(math.isfinite(r["loss"]) for r in read_rows(swarm["metrics"]) if r["loss"] is not None)


def test_a_bf16_trainer_with_an_automatic_micro_batch_averages_with_its_peer(swarm):
    text = swarm["roles"]["bf16"].text()
    assert "--per-device-train-batch-size auto: 4 per micro-batch x 2 accumulated" in text, text[-2000:]
    assert "micro-batch 4 x 2 on cpu in bf16" in text
    joined = events(swarm["roles"]["bf16"], "joined")
    assert [(e["micro_batch"], e["accumulation"]) for e in joined] == [(4, 2)], joined
    assert "Loading micro-batches with 1 DataLoader worker processes" in text
    steps = trainer_rows(swarm["roles"]["bf16"])
    assert max(r["group_size"] for r in steps) == 2, steps
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in steps), steps


def test_the_relay_switch_reaches_p2pd(swarm):
    assert "-relay=0" in p2pd_args(swarm["roles"]["bf16"])  # --no-use-relay
    assert "-relay=1" in p2pd_args(swarm["roles"]["seed"])  # the default


def colab_line() -> list[str]:
    """The seed tutorial's "full trainer script for Google Colab" line, as `cotrain train ARGS`."""
    for role, args, _ in seed_commands():
        if role == "train" and "--client_mode" in args and "300" in args and "--experiment_prefix" in args:
            return [role, *args]
    raise AssertionError("no Colab trainer line (--client_mode, --batch_size_lead 300) in the seed documents")


@pytest.mark.timeout(240)
def test_the_seed_colab_line_joins_a_swarm_with_another_matchmaking_time(swarm, demo_data, tmp_path):
    """The Colab trainer line as written (client mode, --averaging_expiration 10, --batch_size_lead 300, no
    preset), plus a dataset, a local address and a lead below the CPU-sized target, joins the seed lines'
    swarm, whose peers wait 2 s for matchmaking, and averages with them: it takes the run's settings (the
    tiny preset) from the swarm, and matchmaking time, averaging timeout and batch lead are each peer's own,
    not part of the run's agreed settings."""
    initial = swarm["initial"]
    colab = localized(
        colab_line(),
        {
            PEER: initial[0],
            "EXPERIMENT_NAME_HERE": RUN,
            "./outputs": str(tmp_path / "colab"),
            "./logs": str(tmp_path / "colab-logs"),
        },
    )
    assert colab[colab.index("--averaging_expiration") + 1] == "10" and "--client_mode" in colab
    extra = ["--dataset_path", str(demo_data), "--host-maddrs", LOCALHOST, "--batch_size_lead", "16"]
    role = Role([*colab, *extra, "--torch-threads", "1"], tmp_path / "colab.log")
    try:

        def averaged() -> bool:
            assert role.proc.poll() is None, role.text()[-2000:]
            rows = read_rows(tmp_path / "colab" / "metrics.jsonl")
            return any(r.get("group_size", 0) >= 2 for r in rows)

        wait_until(averaged, 200, interval=1.0, what="the Colab-line trainer to average in a group of 2+")
        text = role.text()
        assert "differs from the swarm" not in text and "Traceback" not in text
        assert (
            "Taking the settings of run 'seed-lines' from initial peer" in text
            and "preset albert-tiny" in text
        ), text[-3000:]
    finally:
        role.stop()
