"""`cotrain demo`: a whole swarm on this machine (a monitor and N trainers on 127.0.0.1), then a summary.

Each peer gets the demo's resolved config as a file (every run and per-peer setting the demo was given, plus
the peer's own output folder, seed and addresses), so every flag of the demo reaches every peer."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cotrain.config import Config, write_toml
from cotrain.data import DataError, prepare_from_source, read_manifest
from cotrain.errors import UserError
from cotrain.families import tokenizer_type_for
from cotrain.plots import plot_loss
from cotrain.registry import DEFAULT_STRATEGY, strategy_class

logger = logging.getLogger(__name__)

LOCALHOST = "/ip4/127.0.0.1/tcp/0"
DEMO_PRESET = "albert-tiny"


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def child_config(config: Config, **peer_values: Any) -> Config:
    """A demo peer's resolved config: the demo's whole [run] table and per-peer settings, with this peer's
    own values (output folder, seed, addresses, initial peers, threads) on top."""
    peer = {
        "host_maddrs": [LOCALHOST],
        "announce_maddrs": [],
        "torch_threads": config.peer.torch_threads,  # 0: the trainers share this machine's cores equally
    }
    return dataclasses.replace(config, peer=dataclasses.replace(config.peer, **{**peer, **peer_values}))


class Swarm:
    """Child processes of the demo: each a supervised `cotrain` role with its log in the output folder."""

    def __init__(self, out: Path):
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []

    def start(self, name: str, role: str, config: Config) -> subprocess.Popen:
        """Start `cotrain ROLE --config NAME.toml`, the file holding this peer's whole resolved config."""
        config_file = write_toml(config, self.out / f"{name}.toml")
        log = open(self.out / f"{name}.log", "w")
        self.logs.append(log)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.Popen(
            [sys.executable, "-m", "cotrain", role, "--config", str(config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs[name] = proc
        return proc

    def dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.poll() is not None]

    def stop(self, timeout: float = 14.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def _tokenizer_kind(data: Path) -> str:
    """The type of a prepared dataset's tokenizer (unigram, wordpiece or bpe), "" when unreadable."""
    try:
        return json.loads((data / "tokenizer" / "tokenizer.json").read_text())["model"]["type"].lower()
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _prepare_data(config: Config, data: Path) -> None:

    kind = tokenizer_type_for(config.run.model_family, config.run.objective)
    if (data / "manifest.json").exists():
        try:
            manifest = read_manifest(data)
        except DataError:
            manifest = {}  # another version's layout: prepare again
        if (
            manifest.get("max_length") == config.run.max_seq_length
            and manifest.get("vocab_size") == config.prepare.vocab_size
            and manifest.get("objective") == config.run.objective
            and _tokenizer_kind(data) == kind
        ):
            _say(f"using the demo dataset already prepared in {data}")
            return
    _say("preparing the built-in demo corpus (text that ships with Python) and training a tokenizer")
    prepare_from_source(
        demo=True,
        text_files=None,
        out_dir=data,
        max_length=config.run.max_seq_length,
        seed=0,
        tokenizer_path=None,
        vocab_size=config.prepare.vocab_size,
        progress=False,
        objective=config.run.objective,
        tokenizer_type=kind,
    )


def demo_run_settings(config: Config) -> Config:
    """The config the demo's peers get: the strategy's short demo run where the user set nothing else (diloco
    with no --local-steps on the command line or in a --config file: rounds of DEMO_LOCAL_STEPS x
    target_batch_size samples)."""
    run = strategy_class(config.run.strategy).demo_run(config.run, frozenset(config.run_given))
    return config if run is config.run else dataclasses.replace(config, run=run)


def summarize(rows: list[dict], peers: int, seconds: float, strategy: str = DEFAULT_STRATEGY) -> dict:
    """The demo's result from the monitor's per-step metrics: the mean loss of the first and of the last (up
    to) 3 steps, two windows that never overlap (with 3 steps: the first against the last)."""
    steps = [r for r in rows if r.get("loss") is not None]
    window = max(1, min(3, len(steps) // 2))
    first, last = steps[:window], steps[-window:]

    def mean(rs: list[dict]) -> float | None:
        return round(sum(r["loss"] for r in rs) / len(rs), 4) if rs else None

    return {
        "event": "demo_summary",
        "strategy": strategy,
        "peers": peers,
        "global_steps": max((r["step"] for r in steps), default=0),
        "max_group_size": max((r.get("max_group_size", 1) for r in steps), default=1),
        "loss_first": mean(first),
        "loss_last": mean(last),
        "samples": max((r.get("samples", 0) for r in steps), default=0),
        "seconds": round(seconds, 1),
    }


def _plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        if plot_loss(rows, path, title):
            _say(f"loss curve: {path}")
    except ImportError:
        _say("no loss curve: matplotlib is not installed (pip install 'cotrain[plots]')")
    except Exception as e:  # a picture never fails the demo
        _say(f"no loss curve: {e!r}")


def _step_line(row: dict, strategy: str) -> str:
    """The demo's line for one of the monitor's rows: a global step, or with diloco an outer round."""
    kind = strategy_class(strategy)
    line = (
        f"{kind.step_name} {row['step']}: loss {row['loss']:.3f}, "
        f"{row['alive_peers']} peers, group of {row.get('max_group_size', 1)}, "
        f"{row['samples_per_second']:.1f} samples/s"
    )
    return line + kind.step_words(row, style="demo")


class Stopped(Exception):
    """SIGTERM or SIGHUP reached the demo (``kill PID``, a closed terminal, a service manager)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signal(signum, frame) -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):  # once: a second signal must not cut the stopping short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def run_demo(config: Config) -> int:
    config = demo_run_settings(config)
    demo, strategy = config.demo, config.run.strategy
    root = Path(config.peer.output_dir) / "demo"
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    _prepare_data(config, root / "data")
    swarm = Swarm(root)
    metrics = root / "monitor" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    (root / "monitor" / "initial_peers.txt").unlink(missing_ok=True)
    # from the first peer on: without these, SIGTERM or SIGHUP would end the demo alone, its peers running on
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGHUP, _stop_on_signal)
    # Ctrl+C also where the demo's parent ignored SIGINT (a background job of a script passes that on): the
    # peers' supervisors stop on it anyway, and the demo would take them for crashed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        swarm.start(
            "monitor",
            "monitor",
            child_config(config, output_dir=str(root / "monitor"), initial_peers=[], refresh_period=1.0),
        )
        peers_file = root / "monitor" / "initial_peers.txt"
        while not peers_file.exists():
            if swarm.dead() or time.monotonic() - t0 > 120:
                raise UserError(f"the monitor did not start; see {root / 'monitor.log'}")
            time.sleep(0.2)
        initial = [a for a in peers_file.read_text().split() if "/127.0.0.1/" in a]
        words = strategy_class(strategy).demo_words(config.run, frozenset(config.run_given))
        if words:
            _say(words)
        _say(f"monitor is up at {initial[0]}; starting {demo.peers} trainers")
        url_file = root / "monitor" / "dashboard_url.txt"
        if url_file.exists():
            _say(f"live dashboard: {url_file.read_text().strip()}")
        for i in range(demo.peers):
            trainer = child_config(
                config,
                output_dir=str(root / f"trainer{i}"),
                seed=config.peer.seed + i + 1,
                initial_peers=initial,
                dataset_path=str(root / "data"),
                dataset_url="",
                statistics_expiration=30.0,
            )
            swarm.start(f"trainer{i}", "train", trainer)
        seen = 0
        while True:
            rows = _read_jsonl(metrics)
            for r in rows[seen:]:
                if r.get("loss") is not None:
                    _say(_step_line(r, strategy))
            seen = len(rows)
            summary = summarize(rows, demo.peers, time.monotonic() - t0, strategy)
            if summary["global_steps"] >= demo.steps and summary["max_group_size"] >= 2:
                break
            if time.monotonic() - t0 > demo.deadline:
                _say(f"deadline of {demo.deadline:.0f} s reached")
                break
            if swarm.dead():
                _say(f"{', '.join(swarm.dead())} stopped unexpectedly; see the logs in {root}")
                break
            time.sleep(0.5)
    except (KeyboardInterrupt, Stopped) as e:
        stopped = isinstance(e, Stopped)
        _say(f"{e if stopped else 'interrupted'}: stopping the swarm")
        swarm.stop()
        return 128 + (e.signum if stopped else signal.SIGINT)
    finally:
        if swarm.procs and any(p.poll() is None for p in swarm.procs.values()):
            _say("stopping the swarm")
            swarm.stop()
    rows = _read_jsonl(metrics)
    summary = summarize(rows, demo.peers, time.monotonic() - t0, strategy)
    _plot(rows, root / "loss.png", f"cotrain demo: {demo.peers} peers, {config.run.preset}, {strategy}")
    print(json.dumps(summary), flush=True)
    ok = (
        summary["max_group_size"] >= 2
        and summary["loss_first"] is not None
        and summary["loss_last"] < summary["loss_first"]
    )
    if not ok:
        _say(f"the swarm did not both average (group of 2+) and reduce its loss; logs are in {root}")
    return 0 if ok else 1
