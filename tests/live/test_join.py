"""Joining with only an address: the join command a monitor prints works as printed (DATA replaced) for a
swarm started with a non-default preset; the trainer takes the swarm's settings from the monitor it was given
and averages with a trainer that named them itself."""

from __future__ import annotations

import pytest

from conftest import FAST, LOCALHOST, Role, monitor_address, monitor_args, read_rows, trainer_args, wait_until

pytestmark = [pytest.mark.slow]


def printed_join_command(log: str) -> list[str]:
    """The command line after the monitor's "To join, run:" line, split into arguments."""
    lines = log.splitlines()
    at = next(i for i, line in enumerate(lines) if "To join, run:" in line)
    command = lines[at + 1].split()
    assert command[:2] == ["cotrain", "train"], lines[at + 1]
    return command[1:]


@pytest.mark.timeout(240)
def test_the_printed_join_command_trains_with_the_swarm(demo_data, tmp_path):
    common = ["--preset", "albert-tiny", "--run-id", "join-test", "--host-maddrs", LOCALHOST, *FAST]
    monitor = Role(monitor_args(common, tmp_path / "monitor"), tmp_path / "monitor.log")
    roles = [monitor]
    try:
        initial = monitor_address(tmp_path / "monitor", 60)
        wait_until(lambda: "To join, run:" in monitor.text(), 30, what="the printed join command")
        joined = [a if a != "DATA" else str(demo_data) for a in printed_join_command(monitor.text())]
        assert "--preset" not in joined and "--target-batch-size" not in joined
        # as printed; a test peer also listens on 127.0.0.1 only and writes to its own folder
        joined += [
            "--host-maddrs",
            LOCALHOST,
            "--output-dir",
            str(tmp_path / "joined"),
            "--torch-threads",
            "1",
        ]
        newcomer = Role(joined, tmp_path / "joined.log")
        roles.append(newcomer)
        other = Role(trainer_args(common, initial, demo_data, 2, tmp_path / "other"), tmp_path / "other.log")
        roles.append(other)

        def averaged() -> bool:
            rows = read_rows(tmp_path / "joined" / "metrics.jsonl")
            return any(r.get("group_size", 1) >= 2 for r in rows)

        wait_until(averaged, 240, what="the newcomer averaging in a group of 2")
        text = newcomer.text()
        assert "Taking the settings of run 'join-test' from initial peer" in text, text[-3000:]
        assert "preset albert-tiny" in text
        assert "Reach: public (initial peer " in text  # how it is reached, in one line
        # a monitor named a preset: its join line is the trainer's alone, not a loop of one's own's
        assert "from a training loop of one's own" not in monitor.text()
        config = (tmp_path / "joined" / "config.toml").read_text()
        assert 'preset = "albert-tiny"' in config
        assert "Traceback" not in text
    finally:
        for role in roles:
            if role.proc.poll() is None:
                role.kill_all()
