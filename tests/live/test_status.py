"""`cotrain status` without a swarm.

Here, with cotrain processes; the rest in tests/unit/test_status.py."""

from __future__ import annotations

import pytest

from conftest import LOCALHOST, Role, alive

NOBODY = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWLtHHSrzMTcRbxEGb9yJoRn1SZoxdpCGQoCSqovNfATSa"


@pytest.mark.timeout(120)
def test_status_of_an_unreachable_swarm_is_one_line(tmp_path):
    role = Role(
        ["status", "--initial-peers", NOBODY, "--host-maddrs", LOCALHOST, "--startup-timeout", "10"],
        tmp_path / "status.log",
    )
    role.proc.wait(timeout=100)
    pids = role.tree()
    lines = role.text().strip().splitlines()
    assert role.proc.returncode == 2, lines
    assert lines[-1].startswith("cotrain status: error: no initial peer could be reached"), lines
    assert "Traceback" not in role.text()
    assert not alive(pids), alive(pids)
