"""Trainers that stop together at --max-steps leave their final state to the monitor's last checkpoint,
even when --save-every would not have taken it (a monitor that has made no checkpoint yet, and serves no
state, included): they announce they are leaving and serve it until the monitor holds it. The next trainer
starts from there, not from step 0."""

from __future__ import annotations

import re
import time

import pytest

from conftest import (
    FAST,
    LOCALHOST,
    Role,
    monitor_address,
    monitor_args,
    trainer_args,
    trainer_rows,
    wait_until,
)
from cotrain import checkpoints as ck
from cotrain.hivemind_ext.liveness import GRACE, WATCH_PERIOD

pytestmark = [pytest.mark.slow]


MAX_STEPS = 5  # far below --save-every: the monitor's schedule alone would take no checkpoint at all


@pytest.mark.timeout(240)
def test_trainers_stopping_together_leave_their_final_state_to_the_monitor(demo_data, tmp_path):
    common = ["--preset", "albert-tiny", "--run-id", "leaving-test", "--host-maddrs", LOCALHOST, *FAST]
    checkpoints = ["--dataset-path", str(demo_data), "--save-every", "500", "--load-state-timeout", "20"]
    monitor = Role(monitor_args(common, tmp_path / "monitor", *checkpoints), tmp_path / "monitor.log")
    roles = [monitor]
    try:
        initial = monitor_address(tmp_path / "monitor", 60)
        trainers = [
            Role(
                trainer_args(
                    common, initial, demo_data, i + 1, tmp_path / f"t{i}", "--max-steps", str(MAX_STEPS),
                    "--load-state-timeout", "20",
                ),
                tmp_path / f"t{i}.log",
            )
            for i in range(2)
        ]  # fmt: skip
        roles += trainers
        for trainer in trainers:
            trainer.proc.wait(timeout=240)
            assert trainer.proc.returncode == 0, trainer.text()[-3000:]
        root = tmp_path / "monitor" / "checkpoints"
        wait_until(lambda: ck.latest_good(root) is not None, 10, what="a checkpoint")
        path, meta = ck.latest_good(root)
        assert meta["step"] >= MAX_STEPS, (meta["step"], monitor.text()[-3000:])
        assert any("The monitor holds global step" in t.text() for t in trainers)
        assert "No peer served a state newer" not in monitor.text()
        # the next trainer continues from the monitor's checkpoint
        later = Role(
            trainer_args(common, initial, demo_data, 9, tmp_path / "later", "--load-state-timeout", "20"),
            tmp_path / "later.log",
        )
        roles.append(later)
        found = wait_until(
            lambda: re.search(r"Starting from global step (\d+)", later.text()), 120, what="the next start"
        )
        assert int(found.group(1)) >= MAX_STEPS, later.text()[-3000:]
    finally:
        for role in roles:
            if role.proc.poll() is None:
                role.kill_all()


@pytest.mark.timeout(240)
def test_a_trainer_whose_partner_dies_stops_waiting_for_it_within_a_matchmaking_time(demo_data, tmp_path):
    # the dead partner's progress record stays in the DHT for --metadata-expiration (60 s): the survivor kept
    # counting it and waited a whole averaging round (--averaging-timeout) for it before every step; and the
    # rounds already looking for a group when it died waited out their timeout too
    common = ["--preset", "albert-tiny", "--run-id", "partner-dies", "--host-maddrs", LOCALHOST, *FAST]
    common += ["--averaging-timeout", "20"]  # a wait for nobody would be plain to see
    first = Role(trainer_args(common, [], demo_data, 1, tmp_path / "first"), tmp_path / "first.log")
    roles = [first]
    try:
        initial = wait_until(lambda: re.findall(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", first.text()), 120)
        survivor = Role(
            trainer_args(common, initial[:1], demo_data, 2, tmp_path / "survivor"), tmp_path / "survivor.log"
        )
        roles.append(survivor)
        together = wait_until(
            lambda: len([r for r in trainer_rows(tmp_path / "survivor") if r["group_size"] == 2]) >= 4,
            180,
            what="four steps averaged together",
        )
        assert together
        first.kill_all()  # no goodbye: its progress record stays behind
        killed_at = time.time()
        before = [r for r in trainer_rows(tmp_path / "survivor") if r["time"] <= killed_at]
        wait_until(lambda: len(trainer_rows(tmp_path / "survivor")) >= len(before) + 4, 150, what="4 steps")
        rows = trainer_rows(tmp_path / "survivor")
        together_gaps = [b["time"] - a["time"] for a, b in zip(before[-4:], before[-3:], strict=False)]
        typical = sorted(together_gaps)[len(together_gaps) // 2]
        # alone, a step needs the whole target batch from one peer (twice the compute) and a matchmaking time;
        # the first step after the death also the watch's look at the rounds (a second, and its grace)
        matchmaking = float(FAST[FAST.index("--matchmaking-time") + 1])
        bound = 2.5 * typical + 2 * matchmaking + 3
        after = rows[len(before) - 1 : len(before) + 4]
        gaps = [b["time"] - a["time"] for a, b in zip(after, after[1:], strict=False)]
        text = survivor.text()
        first_bound = bound + WATCH_PERIOD + GRACE
        # a round that waited out its timeout shows as a gap over --averaging-timeout, however loaded the host
        assert gaps[0] < first_bound and max(gaps[1:]) < bound, (gaps, bound, text[-3000:])
        assert max(gaps) < 20, (gaps, text[-3000:])
        assert all(r["group_size"] == 1 for r in after[1:])
        assert "do not answer: training without them" in text
        assert "stop looking for a group, and this peer steps alone" in text
    finally:
        for role in roles:
            if role.proc.poll() is None:
                role.kill_all()
