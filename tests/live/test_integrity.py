"""Integrity of the swarm's records and of its training.

Here, with cotrain processes; the rest in tests/unit/net/test_integrity.py."""

from __future__ import annotations

import math
import re
import signal

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    events,
    monitor_address,
    monitor_args,
    read_rows,
    trainer_args,
    trainer_rows,
    wait_until,
)
from cotrain.keys import config_key, metrics_key
from cotrain.net.configrecord import (
    ConfigMismatch,
    check_agreement,
    make_record,
    read_configs,
)
from cotrain.net.metrics import make_validators, read_metrics
from support.integrity import RUN, metrics, run_config


class SignsButChecksNothing(RSASignatureValidator):
    """A forger's validator: it signs the records under its own key and lets every record through, so that
    its forgeries leave its node and reach the others'."""

    def validate(self, record) -> bool:
        return True


def test_a_differing_config_is_refused_naming_every_field():
    swarm = {bytes([i]): make_record(run_config(), "trainer") for i in range(3)}
    mine = make_record(run_config(learning_rate=0.05, target_batch_size=128), "trainer")
    with pytest.raises(ConfigMismatch) as refused:
        check_agreement(swarm, mine, RUN, b"me")
    message = str(refused.value)
    assert "\n" not in message and f"run {RUN!r}, 3 peers" in message
    assert "learning_rate 0.05 != 0.02" in message and "target_batch_size 128 != 64" in message
    check_agreement(swarm, make_record(run_config(), "trainer"), RUN, b"me")  # the same config joins
    check_agreement({b"me": mine}, make_record(run_config(), "trainer"), RUN, b"me")  # its own old record
    # a lone peer with another config does not outvote the swarm
    odd = {b"odd": make_record(run_config(learning_rate=0.05), "trainer")}
    with pytest.raises(ConfigMismatch, match="learning_rate 0.02 != 0.05"):
        check_agreement(odd, make_record(run_config(), "trainer"), RUN, b"me")
    check_agreement({**swarm, **odd}, make_record(run_config(), "trainer"), RUN, b"me")


@pytest.fixture(scope="module")
def swarm(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity")
    common = ["--preset", "albert-tiny", "--run-id", RUN, "--host-maddrs", LOCALHOST, *FAST]
    common += ["--target-batch-size", "32"]
    roles: dict[str, Role] = {}
    roles["monitor"] = Role(monitor_args(common, out / "monitor"), out / "monitor.log")

    def trainer(name: str, seed: int, *extra: str, env: dict | None = None) -> Role:
        options = ["--statistics-expiration", "30", "--save-steps", "1", "--save-total-limit", "50", *extra]
        args = trainer_args(common, initial, demo_data, seed, out / name, *options)
        roles[name] = Role(args, out / f"{name}.log", env=env)
        return roles[name]

    try:
        initial = monitor_address(out / "monitor", 240)
        trainer("honest", 1)
        trainer("poisoned", 2, env={"COTRAIN_DEBUG_NAN_AT_STEP": "2"})
        trainer("other_lr", 3, "--learning-rate", "0.05")  # the preset's is 0.02
        typo = [a if a != RUN else RUN + "-typo" for a in common]
        roles["mistyped"] = Role(
            ["train", *typo, "--initial-peers", *initial, "--dataset-path", str(demo_data), "--output-dir",
             str(out / "mistyped")],
            out / "mistyped.log",
        )  # fmt: skip
        # the peer of a mistyped run trains on its own: stop it once it has said so
        warning = f"No peer of run '{RUN}-typo' was found through the initial peers, which carry the runs"
        wait_until(lambda: warning in roles["mistyped"].text(), 300, what="the warning about the run id")
        roles["mistyped"].signal_group(signal.SIGINT)
        mistyped_rc = roles["mistyped"].proc.wait(timeout=60)

        def both_past_the_poison() -> bool:
            steps = [
                max((r["step"] for r in trainer_rows(roles[n])), default=0) for n in ("honest", "poisoned")
            ]
            saved = [len(list((out / n / "checkpoints").glob("step-0*4"))) for n in ("honest", "poisoned")]
            return min(steps) >= 4 and min(saved) >= 1

        wait_until(both_past_the_poison, 480, what="both trainers past global step 4, checkpoints saved")
        yield {"out": out, "roles": roles, "initial": initial, "mistyped_rc": mistyped_rc}
    finally:
        for role in roles.values():
            if role.proc.poll() is None:
                role.kill_all()


def finite_checkpoints(folder) -> list[int]:
    """Steps of the checkpoints in ``folder`` whose weights are all finite (asserting that all are)."""
    from safetensors.torch import load_file

    steps = []
    for ck in sorted((folder / "checkpoints").glob("step-*")):
        weights = load_file(ck / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values()), f"non-finite weights in {ck}"
        steps.append(int(ck.name.split("-")[1]))
    return steps


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nan_gradients_stay_with_their_peer(swarm):
    honest, poisoned = swarm["roles"]["honest"], swarm["roles"]["poisoned"]
    # at its first micro-batch at step 2 or later: a slow peer that loaded the swarm's state past step 2 gets
    # there after the rows the fixture waited for
    wait_until(
        lambda: (
            "Non-finite loss or gradients on this micro-batch" in poisoned.text()
            and events(poisoned, "dropped")
        ),
        180,
        what="the poisoned trainer's injected NaN gradient, dropped",
    )
    assert "Fault injection: a NaN gradient" in poisoned.text(), poisoned.text()[-3000:]
    # exactly the poisoned micro-batch was dropped (its loss finite, its gradients not), by that peer only
    dropped = events(poisoned, "dropped")
    assert len(dropped) == 1 and dropped[0]["step"] >= 2, dropped
    assert math.isfinite(dropped[0]["loss"]) and not math.isfinite(dropped[0]["grad_norm"]), dropped
    assert not events(honest, "dropped")
    for role in (honest, poisoned):
        steps = trainer_rows(role)
        assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in steps), steps
        # parameters that turned non-finite would be restored from a backup, with this line: not here
        assert "non-finite parameters" not in role.text(), role.text()[-3000:]
    # the two peers averaged after the injection: NaN sent to the swarm would have reached the honest one
    # (started together, they may each step alone until their progress trackers see each other)
    wait_until(
        lambda: any(r["group_size"] == 2 and r["step"] >= 2 for r in trainer_rows(honest)),
        180,
        what="the honest trainer averaging with the poisoned one after the injection",
    )
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in trainer_rows(honest))
    for name in ("honest", "poisoned"):
        steps = finite_checkpoints(swarm["out"] / name)
        assert max(steps) >= 4, (name, steps)
    assert "Traceback" not in honest.text() + poisoned.text()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_trainer_with_another_config_is_refused_before_averaging(swarm):
    role = swarm["roles"]["other_lr"]
    rc = role.proc.wait(timeout=150)
    text = role.text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert rc != 0 and "Traceback" not in text, text
    assert lines[-1].startswith(
        f"cotrain train: error: this peer's config differs from the swarm's (run {RUN!r}"
    ), text
    assert "learning_rate 0.05 != 0.02" in lines[-1] and "target_batch_size" not in lines[-1]
    assert "joined run" not in text  # refused before its optimizer (and averager) existed
    assert not any(": error: " in line for line in lines[:-1]), text


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_mistyped_run_id_is_named_with_the_runs_that_exist(swarm):
    text = swarm["roles"]["mistyped"].text()
    assert re.search(rf"which carry the runs '{RUN}' \(\d peers?\)", text), text
    assert swarm["mistyped_rc"] == 0 and "Traceback" not in text, text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_forger_changes_no_record_and_no_aggregate(swarm):
    """A real DHT peer signs only its own records and validates nothing, so its forgeries reach the swarm's
    nodes; they must refuse them. An honest reader (full validators) then sees the true records."""
    forger_key = RSAPrivateKey()
    forger = hivemind.DHT(
        initial_peers=swarm["initial"],
        host_maddrs=[LOCALHOST],
        record_validators=[SignsButChecksNothing(forger_key)],
        nat_port_map=False,
        start=True,
    )
    validators, _ = make_validators(RUN)
    reader = hivemind.DHT(
        initial_peers=swarm["initial"],
        host_maddrs=[LOCALHOST],
        record_validators=validators,
        nat_port_map=False,
        client_mode=True,
        start=True,
    )
    try:
        own = RSASignatureValidator(forger_key).local_public_key
        true_records = wait_until(lambda: read_metrics(reader, RUN), 60, what="the trainers' records")
        victim, record = next(iter(true_records.items()))
        victim_config = read_configs(reader, RUN)[victim]
        expiration = get_dht_time() + 120
        forged_config = make_record(run_config(learning_rate=0.5), "trainer")
        forgeries = [
            (metrics_key(RUN), victim, metrics(step=record.step, loss=0.0).dict()),  # another's subkey
            (config_key(RUN), victim, forged_config.dict()),
            (metrics_key(RUN), own, {**metrics().dict(), "samples_per_second": 1e12}),  # out of schema
            (metrics_key(RUN), own, {**metrics().dict(), "loss": -1.0}),
            (config_key(RUN), own, {**forged_config.dict(), "hash": "0" * 16}),  # hash not its content's
        ]
        for key, subkey, value in forgeries:
            forger.store(key, value, expiration, subkey=subkey)
        forged = read_metrics(reader, RUN)
        assert own not in forged and forged[victim].loss > 0, forged  # none of them was accepted
        assert read_configs(reader, RUN)[victim].hash == victim_config.hash
        far_ahead = metrics(step=10**6).dict()  # within the schema: stored, but ignored by the monitor
        forger.store(metrics_key(RUN), far_ahead, expiration, subkey=own)
        assert read_metrics(reader, RUN).get(own) is not None
        monitor_rows = swarm["out"] / "monitor" / "metrics.jsonl"
        seen = len(read_rows(monitor_rows))
        wait_until(lambda: len(read_rows(monitor_rows)) >= seen + 2, 120, what="two more monitor rows")
        after = read_metrics(reader, RUN)
        assert after[victim].loss > 0 and after[victim].step < 10**6
        assert read_configs(reader, RUN)[victim].hash == victim_config.hash
        assert own not in read_configs(reader, RUN)
        for row in read_rows(monitor_rows):
            assert row["step"] < 1000 and row["alive_peers"] <= 2, row
            assert row["samples_per_second"] < 1e6 and (row["loss"] is None or row["loss"] >= 0), row
    finally:
        reader.shutdown()
        forger.shutdown()
