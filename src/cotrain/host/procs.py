"""Process hygiene: every role runs as a thin supervisor plus a worker in its own process group.

hivemind leaves its DHT process, its p2pd daemon and averager processes running when the main process
dies, and they print tracebacks when Ctrl+C reaches the whole terminal group. So:

- the supervisor (the process the user started) owns the signals: on Ctrl+C or SIGTERM it asks the worker
  to stop (SIGTERM), waits a grace period, then kills the worker's whole process group;
- the worker runs in a new session, so the terminal's Ctrl+C never reaches hivemind's children directly;
- the worker watches its supervisor: if the supervisor vanishes (even by SIGKILL) the worker stops and
  kills its own process group, hivemind's children included, when it exits or after a grace period,
  whichever comes first (nobody else is left to clean up after it);
- the worker gets the resolved config as JSON on its standard input (no file for a killed supervisor to
  leave behind), never by parsing the user's command line again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from cotrain.config import Config, resolved_json

logger = logging.getLogger(__name__)

GRACE_SECONDS = 10.0  # from a stop request to SIGKILL of whatever is left
SUPERVISOR_ENV = "COTRAIN_SUPERVISOR_PID"


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def supervisor_pid() -> int | None:
    """The PID of the supervisor that started this worker (None outside a supervised worker)."""
    pid = os.environ.get(SUPERVISOR_ENV)
    return int(pid) if pid else None


def exit_worker(rc: int, supervisor_pid: int | None) -> None:
    """End a worker process: where its supervisor is gone, with its whole process group (what hivemind left
    running dies with it; the supervisor would have killed it), else alone."""
    sys.stdout.flush()
    sys.stderr.flush()
    if supervisor_pid is not None and os.getppid() != supervisor_pid and os.getpgrp() == os.getpid():
        kill_group(os.getpgrp())
    os._exit(rc)


def supervise(role: str, config: Config) -> int:
    """Run ``python -m cotrain._worker ROLE --resolved-config -`` as a worker in its own session, the
    resolved ``config`` on its standard input (the worker never parses the user's command line again; no file
    is left behind, however the supervisor ends); return the worker's exit code."""
    return _run_worker([sys.executable, "-m", "cotrain._worker", role, "--resolved-config", "-"], config)


def start_worker(command: list[str], config: Config, **popen) -> subprocess.Popen:
    """Start ``command`` (a worker reading ``--resolved-config -``) and hand it ``config`` on its standard
    input, which is then closed."""
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, **popen)
    with contextlib.suppress(BrokenPipeError), proc.stdin:  # a worker already gone: its exit code says why
        proc.stdin.write(resolved_json(config).encode())
    return proc


def worker_env() -> dict[str, str]:
    """The worker's environment: this one, the supervisor's pid, and two malloc arenas unless the user set
    ``MALLOC_ARENA_MAX``. glibc gives each thread that allocates an arena of its own (up to 8 per core), and
    each arena keeps the peak it reached: the DHT's and the averagers' threads beside the training loop held
    a tiny-model trainer 56 MiB (9%) larger with glibc's default (docs/benchmarks.md)."""
    env = dict(os.environ, **{SUPERVISOR_ENV: str(os.getpid())})
    env.setdefault("MALLOC_ARENA_MAX", "2")
    return env


def _run_worker(command: list[str], config: Config) -> int:
    proc = start_worker(command, config, start_new_session=True, env=worker_env())
    stop_requested: list[float] = []

    def on_signal(signum, frame):
        if not stop_requested:
            stop_requested.append(time.monotonic())
            try:  # the worker says which it was (Ctrl+C, kill); a lost terminal (SIGHUP) stops it as SIGTERM
                proc.send_signal(signum if signum in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM)
            except ProcessLookupError:
                pass
        elif signum == signal.SIGINT:  # a second Ctrl+C: stop now
            kill_group(proc.pid)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    while True:
        try:
            rc = proc.wait(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            if stop_requested and time.monotonic() - stop_requested[0] > GRACE_SECONDS:
                kill_group(proc.pid)
    kill_group(proc.pid)  # hivemind's children that outlived the worker
    if rc < 0:
        return 0 if stop_requested else 128 - rc
    return rc


class StopSignals:
    """In the worker: turn SIGTERM/SIGINT and the supervisor's disappearance into a stop event, with a hard
    deadline after which the whole process group is killed."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.pid = os.getpid()
        self._deadline_started = False
        self.supervisor_pid = supervisor_pid()

    def install(self) -> StopSignals:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        if self.supervisor_pid is not None:
            threading.Thread(target=self._watch_supervisor, daemon=True, name="supervisor-watch").start()
        return self

    def request_stop(self, reason: str) -> None:
        if not self.event.is_set():
            logger.info(f"Stopping ({reason})")
            self.event.set()
        if not self._deadline_started:
            self._deadline_started = True
            timer = threading.Timer(GRACE_SECONDS, self._hard_stop)
            timer.daemon = True
            timer.start()

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            # a process hivemind forked from the worker inherited this handler: behave as if it had none,
            # so that hivemind's own terminate() works
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.request_stop(signal.Signals(signum).name)

    def _watch_supervisor(self) -> None:
        while not self.event.wait(0.5):
            if os.getppid() != self.supervisor_pid:
                self.request_stop("the supervising process is gone")
                return

    @staticmethod
    def _hard_stop() -> None:
        logging.getLogger(__name__).warning("Shutdown took too long; killing the remaining processes")
        if os.getpgrp() == os.getpid():  # only a group leader (a supervised worker) kills its whole group
            kill_group(os.getpgrp())
        os._exit(1)
