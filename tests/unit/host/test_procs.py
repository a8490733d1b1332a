"""Process hygiene without a swarm.

Here, in the test process alone; the rest in tests/live/test_procs.py."""

from __future__ import annotations

import os

from cotrain.host.procs import SUPERVISOR_ENV, worker_env


def test_the_worker_gets_two_malloc_arenas_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    env = worker_env()
    assert env["MALLOC_ARENA_MAX"] == "2" and env[SUPERVISOR_ENV] == str(os.getpid())
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert worker_env()["MALLOC_ARENA_MAX"] == "8"
