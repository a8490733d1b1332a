"""Helpers the test_dht tests share across suites."""

import os


def _own_daemons() -> list:
    """The running libp2p daemons of this process (a DHT in a thread starts one; another peer's is not)."""
    return _daemons_of(os.getpid())


def _daemons_of(pid: int) -> list:
    """The running libp2p daemons that the process ``pid`` started (psutil processes)."""
    import psutil

    return [p for p in psutil.Process(pid).children() if p.name() == "p2pd" and p.status() != "zombie"]
