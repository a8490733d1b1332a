"""Per-peer network settings.

Here, in the test process alone; the rest in tests/live/test_peers.py."""

from __future__ import annotations

import re
import shlex
import stat

import pytest

from conftest import (
    REPO,
)
from cotrain.errors import UserError
from cotrain.net.identity import ensure_identity


def test_a_new_identity_is_private_and_stable(tmp_path):
    path = tmp_path / "keys" / "peer.id"
    first = ensure_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_identity(path) == first
    assert sorted(p.name for p in path.parent.iterdir()) == ["peer.id"]  # no temporary file left


def test_an_identity_open_to_other_users_is_used_with_one_warning(tmp_path, caplog):
    import logging
    import os

    path = tmp_path / "peer.id"
    old = os.umask(0)  # a permissive umask: the new file is still its owner's only
    try:
        first = ensure_identity(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for mode in (0o644, 0o640, 0o606):
        path.chmod(mode)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert ensure_identity(path) == first  # still used
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(path) in warnings[0], (oct(mode), warnings)
        assert f"run `chmod 600 {path}`" in warnings[0] and "identity file" in warnings[0], warnings
    path.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ensure_identity(path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("content", [b"", b"not a key at all", b"\x08\x00\x12\x05hello"])
def test_a_corrupt_identity_is_one_clear_error(tmp_path, content):
    path = tmp_path / "peer.id"
    path.write_bytes(content)
    with pytest.raises(UserError, match="is not a private key"):
        ensure_identity(path)
    assert path.read_bytes() == content  # left as it was


def test_the_deploy_guide_command_lines_parse():
    """Every `cotrain ...` line of docs/deploy.md is accepted by the command line as it is."""
    from cotrain import cli

    text = (REPO / "docs" / "deploy.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("cotrain "):
                commands.append(shlex.split(line)[1:])
    assert {argv[0] for argv in commands} >= {"prepare", "monitor", "train"}, commands
    for argv in commands:
        cli.parse(argv)  # an unknown flag or a bad value exits here
