"""Private swarms.

Here, with hivemind in the test process; the rest in tests/live/test_auth.py and
tests/unit/access/test_auth.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from cotrain.errors import UserError
from support.auth import RUN, issue

REVOKED_CAROL = "access token 'carol' was revoked by the swarm's operator"


def watch_refusal(tmp_path: Path, caplog) -> str:
    """A running peer's access watcher, run until the swarm refuses carol's token (revoked); its refusal."""
    import concurrent.futures
    import logging
    import threading

    from cotrain.access import AccessControl
    from cotrain.net.probe import AccessWatcher, Verdict

    class DHT:
        access = AccessControl.for_token(RUN, str(issue(tmp_path, "carol")))

        def run_coroutine(self, coroutine, return_future):
            future = concurrent.futures.Future()
            future.set_result(Verdict(stop=REVOKED_CAROL))
            return future

    watcher = AccessWatcher(DHT(), [], threading.Event(), period=0.01)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cotrain.net.probe"):
        watcher.run()
    assert watcher.stop.is_set() and watcher.refusal == f"the swarm refused this peer: {REVOKED_CAROL}"
    return watcher.refusal


def test_a_refused_peer_outside_a_worker_logs_why(tmp_path, monkeypatch, caplog):
    """A SwarmPeer of the Python API has no worker to print the swarm's refusal: its watcher logs it."""
    from cotrain.net.probe import AccessWatcher

    monkeypatch.setattr(AccessWatcher, "logs_refusal", True)
    watch_refusal(tmp_path, caplog)
    assert [r.getMessage() for r in caplog.records] == [f"the swarm refused this peer: {REVOKED_CAROL}"]


@pytest.mark.parametrize(
    "ends", [0, UserError("the swarm's settings were not found"), RuntimeError("stopped mid-step")]
)
def test_a_refused_role_says_so_once_as_its_error_line(tmp_path, monkeypatch, capsys, caplog, ends):
    """A role's worker prints the swarm's refusal as the role's one error line, whatever else the stop made
    the role end with, and its watcher logs nothing of it."""
    import threading
    from types import SimpleNamespace

    from cotrain import _worker
    from cotrain.net.probe import AccessWatcher

    monkeypatch.setattr(AccessWatcher, "logs_refusal", True)  # put back after the worker sets it

    class Role:
        def __init__(self, config, stop) -> None:
            self.connection = SimpleNamespace(refusal=None)

        def run(self) -> int:
            self.connection.refusal = watch_refusal(tmp_path, caplog)
            assert caplog.records == [], caplog.text  # the watcher said nothing: the worker says it
            if isinstance(ends, Exception):
                raise ends
            return ends

        def close(self) -> None:
            pass

    config = SimpleNamespace(peer=SimpleNamespace(verbose=False))
    signals = SimpleNamespace(event=threading.Event())
    monkeypatch.setattr(_worker, "load_resolved", lambda path: config)
    monkeypatch.setattr(_worker, "setup_logging", lambda verbose: None)
    monkeypatch.setattr(_worker, "write_output_config", lambda config: None)
    monkeypatch.setattr(_worker, "StopSignals", lambda: SimpleNamespace(install=lambda: signals))
    monkeypatch.setattr(_worker, "quiet_while_stopping", lambda event: None)
    monkeypatch.setattr(_worker, "role_class", lambda command: Role)
    capsys.readouterr()
    assert _worker.run_role("train", "-") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"cotrain train: error: the swarm refused this peer: {REVOKED_CAROL}"
    ]
