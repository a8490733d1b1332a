"""Shared fixtures: real peers as processes on 127.0.0.1, and a guard that no test peer listens elsewhere."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from cotrain.host.shm import remove_leftovers

# fixtures that tests of several suites share (tests/support/)
pytest_plugins = [
    "support.checkpoints",
    "support.data_prepare",
    "support.data_stream",
    "support.diloco_peers",
    "support.families",
    "support.hostile",
    "support.voters",
]

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
ASSETS = TESTS / "assets"
SHARED = REPO.parent / "shared"  # beside the repository in the project's workspace; absent in a fresh clone
# Real WikiText-2 (validation split, the wikitext-103-v1 format) when it is beside the repository; otherwise a
# sample in the same format written for the tests. Tests whose thresholds depend on the corpus's size read
# WIKITEXT_IS_REAL; the same assertions run on either.
WIKITEXT_IS_REAL = (SHARED / "data" / "wikitext-2" / "valid.txt").is_file()
WIKITEXT = SHARED / "data/wikitext-2/valid.txt" if WIKITEXT_IS_REAL else ASSETS / "wikitext_sample.txt"


def at_least(real: int, sample: int) -> int:
    """A size threshold for a test on WIKITEXT: ``real`` on WikiText-2 (213,886 words), ``sample`` on the
    committed sample (about 6,000 words)."""
    return real if WIKITEXT_IS_REAL else sample


# The seed documents (the original recipe's guides), or their command lines kept in the repository.
SEEDS_DIR = SHARED / "seeds" if (SHARED / "seeds").is_dir() else ASSETS / "seeds"
LOCALHOST = "/ip4/127.0.0.1/tcp/0"
DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t"  # nothing answers
# timeouts shrunk so that a multi-peer run takes seconds on 2 loaded cores
FAST = [
    "--matchmaking-time",
    "2",
    "--averaging-timeout",
    "10",
    "--torch-threads",
    "1",
    "--startup-timeout",
    "30",
]


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def _netns(pid: int | str) -> int | None:
    """Inode of the network namespace of a process (``"self"``: this one)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


class NetworkGuard(threading.Thread):
    """Watches every process this test session started and records any socket listening off loopback.

    Processes inside a network namespace that the test created itself (``allow_namespace``) are exempt:
    there, addresses exist only inside the test's own namespaces."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.violations: list[str] = []
        self.stop = threading.Event()
        self.own_netns = _netns("self")
        self.allowed_netns: set[int] = set()

    def allow_namespace(self, name: str) -> None:
        """Exempt processes in network namespace ``name``, which the test created (``ip netns add NAME``)."""
        ino = os.stat(f"/run/netns/{name}").st_ino
        assert ino != self.own_netns, f"{name} is the test runner's own network namespace"
        self.allowed_netns.add(ino)

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(0.5):
            for proc in me.children(recursive=True):
                if self.allowed_netns:
                    ns = _netns(proc.pid)
                    if ns is not None and ns != self.own_netns and ns in self.allowed_netns:
                        continue
                try:
                    conns = proc.net_connections(kind="inet")
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                for c in conns:
                    if c.status == psutil.CONN_LISTEN and not _is_loopback(c.laddr.ip):
                        self.violations.append(
                            f"{proc.name()} (pid {proc.pid}) listens on {c.laddr.ip}:{c.laddr.port}"
                        )


@pytest.fixture(autouse=True)
def network_guard():
    """Fails any test whose peers listen on an address other than 127.0.0.1."""
    guard = NetworkGuard()
    guard.start()
    yield guard
    guard.stop.set()
    guard.join(timeout=5)
    assert not guard.violations, f"a test peer listened off loopback: {sorted(set(guard.violations))}"


SESSION_STARTED = time.time()


# how long a live test may wait for its share of the machine (machine_share): a bound of its own, apart from
# the test's timeout; the longest live test holds the machine for at most its own timeout (240 s)
SHARE_WAIT = 600.0


SHARE_MISSED = pytest.StashKey[float]()


def _flock_within(handle, kind: int, item) -> bool:
    """Takes a lock on ``handle`` within SHARE_WAIT seconds; False (and the test marked to fail in its set-up,
    share_bound below) where it could not."""
    deadline = time.monotonic() + SHARE_WAIT
    while True:
        try:
            fcntl.flock(handle, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                item.stash[SHARE_MISSED] = SHARE_WAIT
                return False
            time.sleep(0.2)


@pytest.fixture(autouse=True)
def share_bound(request):
    """Fails a live test that waited past SHARE_WAIT for its share of the machine (machine_share)."""
    if SHARE_MISSED in request.node.stash:
        pytest.fail(f"waited {SHARE_WAIT:.0f} s for its share of the machine", pytrace=False)


@contextlib.contextmanager
def machine_share(item):
    """Under xdist, a live test (``slow``) holds a shared lock on this run's machine while it runs, and one
    marked ``alone`` (peers of several ranks: more processes computing than there are cores) an exclusive
    one: the other worker's live tests, whose peers must meet within seconds, wait until it ends. A turnstile
    keeps a waiting ``alone`` test from being passed by the other worker's next tests."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None or item.get_closest_marker("slow") is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"cotrain-tests-{run}"
    alone = item.get_closest_marker("alone") is not None
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        if not _flock_within(turnstile, fcntl.LOCK_EX, item):
            yield
            return
        try:
            held = _flock_within(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, item)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        if not held:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


SUITES = ("unit", "swarm", "live")


def pytest_collection_modifyitems(items):
    """Each test carries the mark of its suite, the folder it lies in: ``-m unit``, ``-m "not live"``."""
    for item in items:
        suite = Path(str(item.path)).relative_to(TESTS).parts[0]
        if suite in SUITES:
            item.add_marker(suite)


def pytest_configure(config):
    """Under xdist, the run's id is chosen here, so that the controller knows it too (below)."""
    if not hasattr(config, "workerinput") and getattr(config.option, "testrunuid", "") is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_sessionfinish(session):
    """The controller, once its workers are gone, removes this run's lock files (machine_share)."""
    run = getattr(session.config.option, "testrunuid", None)
    if run and not hasattr(session.config, "workerinput"):
        for suffix in (".lock", ".turnstile"):
            (Path(tempfile.gettempdir()) / f"cotrain-tests-{run}{suffix}").unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """The machine's share (above) is taken outside the test's timeout: waiting for it is not the test's."""
    with machine_share(item):
        yield


@pytest.fixture(autouse=True, scope="module")
def shared_memory_cleanup():
    """After each test file (its peers are gone by then), the shared-memory files its killed peers left:
    without this, a full run leaves about 1 GB in RAM (cotrain.host.shm)."""
    yield
    remove_leftovers(since=SESSION_STARTED)


def check_announced(maddrs: list[str]) -> None:
    for addr in maddrs:
        ip = addr.split("/")[2]
        assert _is_loopback(ip), f"a test peer announced a non-loopback address: {addr}"


def cotrain_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


# every role's log with the test file that started it, in order of start: a failed test's report shows the
# tails of its file's logs (a module's story starts roles in one test and checks them in the next)
ROLE_LOGS: list[tuple[str, Path]] = []
LOG_TAIL_LINES = 25


def _test_file() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the last lines of the logs of the roles its test file started."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when == "call":
        here = item.nodeid.split("::")[0]
        for log in [log for file, log in ROLE_LOGS if file == here][-8:]:
            try:
                tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            except OSError:
                continue
            report.sections.append((f"role log {log}", "\n".join(tail)))


class Role:
    """A `cotrain` role started as a user would start it: in its own process group, like a terminal job."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.check_listen(args)
        ROLE_LOGS.append((_test_file(), log))
        self.args = args
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cotrain", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**cotrain_env(), **(env or {})},
            start_new_session=True,
        )
        self.pid = self.proc.pid

    @staticmethod
    def check_listen(args: list[str]) -> None:
        """Refuses a peer's command line that does not say explicitly to listen on 127.0.0.1."""
        if args[0] in ("train", "monitor"):
            assert "--host-maddrs" in args and LOCALHOST in args, "test peers must listen on 127.0.0.1 only"

    def tree(self) -> list[int]:
        """PIDs of the supervisor, its worker and everything in the worker's process group."""
        pids = {self.pid}
        try:
            for child in psutil.Process(self.pid).children(recursive=True):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) in pids:
                    pids.add(p.pid)
            except (ProcessLookupError, PermissionError):
                pass
        return sorted(pids)

    def text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal_group(self, sig: int) -> None:
        os.killpg(self.pid, sig)

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_all()
        self._log.close()

    def kill_all(self) -> None:
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_until(predicate, timeout: float, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def read_rows(path: Path) -> list[dict]:
    """The JSON lines of a file another process appends to; none while it does not exist, and a last line
    still being written is left for the next read."""
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def saw_peers(rows: list[dict], n: int) -> bool:
    """Whether a monitor's training rows ever counted ``n`` (or more) alive peers at once."""
    return any(r.get("alive_peers", 0) >= n for r in rows if r.get("kind") != "eval")


def monitor_args(common: list[str], out_dir: Path, *extra: str, dashboard_port: str = "-1") -> list[str]:
    """A `cotrain monitor` command line: ``common``, output to ``out_dir``, a refresh every 0.5 s and no
    dashboard (unless ``dashboard_port`` says otherwise), then ``extra``."""
    args = ["monitor", *common, "--output-dir", str(out_dir), "--refresh-period", "0.5"]
    return [*args, "--dashboard-port", dashboard_port, *extra]


def monitor_address(out_dir: Path, timeout: float, what: str = "the monitor's address") -> list[str]:
    """The addresses a monitor writing to ``out_dir`` announces, once its ``initial_peers.txt`` exists."""
    peers_file = out_dir / "initial_peers.txt"
    wait_until(peers_file.exists, timeout, what=what)
    return peers_file.read_text().split()


def trainer_args(
    common: list[str], initial: list[str], data: Path, seed: int, out_dir: Path, *extra: str
) -> list[str]:
    """A `cotrain train` command line: ``common``, joining through ``initial`` (none: alone), training on
    ``data`` with ``seed`` in micro-batches of 8, output to ``out_dir``, then ``extra`` (a later option of the
    same name wins)."""
    args = ["train", *common, *(["--initial-peers", *initial] if initial else [])]
    args += ["--dataset-path", str(data), "--seed", str(seed), "--per-device-train-batch-size", "8"]
    return [*args, "--output-dir", str(out_dir), *extra]


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small prepared dataset (built-in corpus) shared by the multi-peer tests. Its examples are of 64
    tokens, half the preset's longest: a trainer's step then costs about a sixth less of the machine's time,
    which the peers of two tests running at once share."""
    from cotrain.data import prepare_from_source

    out = tmp_path_factory.mktemp("data") / "demo"
    prepare_from_source(
        demo=True,
        text_files=None,
        out_dir=out,
        max_length=64,
        seed=0,
        tokenizer_path=None,
        vocab_size=4000,
        progress=False,
    )
    return out


def output_dir(role: Role) -> Path:
    """The --output-dir (or the seed spelling --output_dir) of a role's command line; the last one wins."""
    flags = [i for i, a in enumerate(role.args) if a in ("--output-dir", "--output_dir")]
    assert flags, f"no --output-dir in {role.args}"
    return Path(role.args[flags[-1] + 1])


def trainer_rows(where: Role | Path) -> list[dict]:
    """The global steps a trainer completed, in order: the rows of its OUTPUT_DIR/metrics.jsonl (step, loss,
    group_size, contribution, ...). ``where``: the trainer's Role or its output folder. A folder that several
    trainers used in turn holds all their rows."""
    folder = output_dir(where) if isinstance(where, Role) else Path(where)
    return read_rows(folder / "metrics.jsonl")


def events(where: Role | Path, name: str | None = None) -> list[dict]:
    """A trainer's events (OUTPUT_DIR/events.jsonl: joined, resumed, started, adopted, dropped, stopping,
    leaving), in order; only those called ``name`` when it is given."""
    folder = output_dir(where) if isinstance(where, Role) else Path(where)
    return [e for e in read_rows(folder / "events.jsonl") if name is None or e["event"] == name]


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test (tiny models run fastest so, and the cores are shared with the peers
    of other tests); the previous count afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def state_holder(dhts: list, run_id: str, epoch: int | None, kind=None, optimizer=None, **kwargs):
    """A state holder of run ``run_id`` on a new DHT on 127.0.0.1 joined to ``dhts[0]`` (appended to
    ``dhts``): ``kind`` (default cotrain.hivemind_ext.statecheck.CheckedTrainingStateAverager) over a
    Linear(8, 4) whose weights depend on ``epoch``, serving its state at step ``epoch`` (None: a newcomer
    that serves none)."""
    import hivemind
    import torch

    from cotrain.hivemind_ext import statecheck as sc

    initial = dhts[0].get_visible_maddrs() if dhts else []
    dhts.append(
        hivemind.DHT(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial, nat_port_map=False, start=True
        )
    )
    torch.manual_seed(epoch or 0)
    made = (kind or sc.CheckedTrainingStateAverager)(
        dht=dhts[-1],
        prefix=f"{run_id}_state_averager",
        optimizer=optimizer or (lambda params: torch.optim.SGD(params, lr=0.1)),
        params=torch.nn.Linear(8, 4).parameters(),
        allow_state_sharing=epoch is not None,
        declare_state_period=5,
        start=True,
        **kwargs,
    )
    if epoch is not None:
        made.local_epoch = epoch
        made.state_sharing_priority = epoch
    return made
