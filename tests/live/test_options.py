"""Every option of the original trainer and monitor.

Here, with cotrain processes; the rest in tests/unit/test_options.py."""

from __future__ import annotations

import subprocess
import sys


def test_an_old_style_initial_peer_is_one_line_with_the_form_to_use(tmp_path):
    """The seed notebook's `--initial_peers 18.224.82.24:31337`: one line naming the full multiaddr form, a
    non-zero exit, no traceback, and no connection attempted (the address is refused before the network
    starts)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cotrain",
            "train",
            "--initial_peers",
            "18.224.82.24:31337",
            "--preset",
            "albert-tiny",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "/ip4/18.224.82.24/tcp/31337/p2p/" in lines[0]
