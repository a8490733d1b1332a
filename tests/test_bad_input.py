"""Bad input, table-driven: every row ends in one clear line, a non-zero exit, no traceback and no file left.

Most rows call the CLI's entry function (`cotrain.cli.main`) in this process; the rows that need the network
layer or a training process start `cotrain` as a user would. ``python tests/test_bad_input.py`` runs every row
and prints the table recorded in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import LOCALHOST, cotrain_env  # noqa: E402

DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t"
CK = "{ws}/checkpoints/step-000003"
TRUNCATED = "{ws}/truncated/step-000005"
TRAIN = ["train", "--preset", "albert-tiny", "--host-maddrs", LOCALHOST, "--output-dir", "{ws}/out"]
STATUS = ["status", "--host-maddrs", LOCALHOST]

# (what, command line, what the one line says, how it runs: "call" in this process or "process")
CASES: list[tuple[str, list[str], str, str]] = [
    ("unknown preset", ["config", "show", "albert-giant"], "unknown preset 'albert-giant'", "call"),
    ("unknown preset (train)", ["train", "--preset", "nope"], "unknown preset 'nope'", "call"),
    ("zero micro-batch", [*TRAIN, "--per-device-train-batch-size", "0"], "positive", "call"),
    ("negative micro-batch", [*TRAIN, "--per-device-train-batch-size", "-4"], "positive", "call"),
    ("zero target batch", [*TRAIN, "--target-batch-size", "0"], "target_batch_size must be positive", "call"),
    (
        "target smaller than a micro-batch",
        [*TRAIN, "--target-batch-size", "4", "--per-device-train-batch-size", "8"],
        "is smaller than one step of this peer",
        "call",
    ),
    (
        "batch size lead at the target",
        [*TRAIN, "--target-batch-size", "64", "--batch-size-lead", "200"],
        "batch_size_lead (200) must be below target_batch_size (64)",
        "call",
    ),
    ("not a number", [*TRAIN, "--learning-rate", "fast"], "invalid float value: 'fast'", "call"),
    (
        "NaN learning rate",
        [*TRAIN, "--learning-rate", "nan"],
        "learning_rate must be a finite number",
        "call",
    ),
    ("negative max steps", [*TRAIN, "--max-steps", "-1"], "must not be negative", "call"),
    (
        "client and public",
        [*TRAIN, "--client-mode", "--public"],
        "--client-mode and --public contradict each other",
        "call",
    ),
    ("run id with a dot", [*TRAIN, "--run-id", "my.run"], "run_id 'my.run' must be non-empty", "call"),
    ("unknown flag", [*TRAIN, "--frobnicate", "3"], "unrecognized arguments: --frobnicate", "call"),
    ("unknown command", ["fly"], "invalid choice: 'fly'", "call"),
    ("missing config file", [*TRAIN, "--config", "{ws}/none.toml"], "none.toml does not exist", "call"),
    ("invalid TOML", [*TRAIN, "--config", "{ws}/broken.toml"], "is not valid TOML", "call"),
    (
        "unknown TOML key",
        [*TRAIN, "--config", "{ws}/unknown_key.toml"],
        "unknown key run.learning_rat",
        "call",
    ),
    ("unknown TOML table", [*TRAIN, "--config", "{ws}/bad_table.toml"], "unknown section [trainer]", "call"),
    (
        "bad TOML value type",
        [*TRAIN, "--config", "{ws}/bad_type.toml"],
        "run.learning_rate: expected float, got str 'fast'",
        "call",
    ),
    (
        "model config with a model_type of the wrong type",
        [*TRAIN, "--model-config-path", "{ws}/model_type.json"],
        "model_type must be a string, got an integer",
        "call",
    ),
    (
        "model config with values of the wrong type",
        [*TRAIN, "--model-config-path", "{ws}/model_types.json"],
        "hidden_size must be an integer (as in the preset), got a string 'wide'",
        "call",
    ),
    (
        "model config nested too deeply",
        [*TRAIN, "--model-config-path", "{ws}/deep.json"],
        "cannot read a JSON model config (nested too deeply)",
        "call",
    ),
    ("malformed multiaddr", [*STATUS, "--initial-peers", "/ip4/nonsense"], "malformed initial peer", "call"),
    ("old-style IP:PORT peer", [*STATUS, "--initial-peers", "10.0.0.1:1337"], "old-style IP:PORT", "call"),
    ("missing dataset", [*TRAIN, "--dataset-path", "{ws}/no-data"], "no prepared dataset at", "call"),
    (
        "export of a truncated checkpoint",
        ["export", TRUNCATED, "{ws}/exported"],
        "model.safetensors is truncated or corrupted",
        "call",
    ),
    (
        "read-only output folder",
        ["monitor", "--host-maddrs", LOCALHOST, "--output-dir", "{ro}/monitor"],
        "cannot write to the output folder",
        "call",
    ),
    (
        "dashboard port out of range",
        ["monitor", "--dashboard-port", "70000"],
        "dashboard_port must be",
        "call",
    ),
    (
        "export of a missing checkpoint",
        ["export", "{ws}/none", "{ws}/exported"],
        "has no checkpoint.json",
        "call",
    ),
    (
        "export of a corrupted checkpoint",
        ["export", CK, "{ws}/exported"],
        "checkpoint.json is corrupted",
        "call",
    ),
    (
        "prepare of an empty corpus",
        ["prepare", "--text-files", "{ws}/empty.txt", "--output", "{ws}/prepared"],
        "no text in",
        "call",
    ),
    (
        "prepare of a missing file",
        ["prepare", "--text-files", "{ws}/none.txt", "--output", "{ws}/prepared"],
        "text file not found",
        "call",
    ),
    (
        "prepare of no corpus",
        ["prepare", "--output", "{ws}/prepared"],
        "no corpus: pass --text-files",
        "call",
    ),
    (
        "prepare into a read-only folder",
        ["prepare", "--demo-corpus", "--preset", "albert-tiny", "--output", "{ro}/prepared"],
        "cannot write to the folder of --output",
        "call",
    ),
    ("demo with no peers", ["demo", "--peers", "0"], "demo peers and steps must be at least 2", "call"),
    ("demo with a lone peer", ["demo", "--peers", "1"], "demo peers and steps must be at least 2", "call"),
    ("demo of one step", ["demo", "--steps", "1"], "demo peers and steps must be at least 2", "call"),
    ("a node under sync", [*TRAIN, "--nproc-per-node", "2"], "trains with --strategy diloco", "call"),
    (
        "a node with LAMB",
        [*TRAIN, "--strategy", "diloco", "--nproc-per-node", "2"],
        "'lamb' cannot do",
        "call",
    ),
    ("no dataset given", [*TRAIN], "give one of --dataset-path", "process"),
    (
        "GPUs that do not exist",
        [*TRAIN, "--dataset-path", "{data}", "--devices", "cuda:0,cuda:63"],
        "does not exist here",
        "process",
    ),
    (
        "a model too small to shard",
        [*TRAIN, "--dataset-path", "{data}", "--strategy", "diloco", "--optimizer", "adamw"]
        + ["--devices", "cpu", "--nproc-per-node", "4096"],
        "too small to shard over 4096 ranks",
        "process",
    ),
    ("peer without /p2p/", [*TRAIN, "--initial-peers", "/ip4/10.0.0.1/tcp/5"], "lacks its /p2p/", "process"),
    (
        "resume from a corrupted checkpoint",
        [*TRAIN, "--resume-from", CK],
        "checkpoint.json is corrupted",
        "process",
    ),
    (
        "unreachable initial peer",
        [*TRAIN, "--initial-peers", DEAD_PEER],
        "no initial peer could be reached",
        "process",
    ),
    (
        "port in use",
        [
            "train",
            "--preset",
            "albert-tiny",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/{port}",
            "--dataset-path",
            "{data}",
            "--output-dir",
            "{ws}/out",
        ],
        "address already in use",
        "process",
    ),
    (
        "corrupted dataset shard",
        [*TRAIN, "--dataset-path", "{corrupt}", "--target-batch-size", "16", "--max-steps", "1"],
        "is corrupt",
        "process",
    ),
]


def _mount_read_only(folder: Path) -> bool:
    """A folder nobody can write to, root included: a read-only tmpfs (root), or mode 0555 (others)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True
    )
    return done.returncode == 0


@contextlib.contextmanager
def workspace(root: Path, data: Path | None = None) -> Iterator[dict[str, str]]:
    """The files the bad inputs point at, a read-only folder and a busy port."""
    (root / "broken.toml").write_text("[run\nlearning_rate = 0.1\n")
    (root / "unknown_key.toml").write_text("[run]\nlearning_rat = 0.1\n")
    (root / "bad_table.toml").write_text("[trainer]\nlearning_rate = 0.1\n")
    (root / "bad_type.toml").write_text("[run]\nlearning_rate = 'fast'\n")
    (root / "model_type.json").write_text('{"model_type": 5}')
    (root / "model_types.json").write_text('{"hidden_size": "wide", "num_attention_heads": [4]}')
    (root / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "empty.txt").write_text("\n\n")
    ck = Path(CK.format(ws=root))
    ck.mkdir(parents=True)
    (ck / "checkpoint.json").write_text('{"format": "cotrain-checkpoint/1", "step": 3, "files": {"mod')  # cut
    truncated = Path(TRUNCATED.format(ws=root))
    truncated.mkdir(parents=True)
    weights = os.urandom(4096)
    files = {
        name: hashlib.sha256(weights).hexdigest() for name in ("model.safetensors", "optimizer.safetensors")
    }
    (truncated / "model.safetensors").write_bytes(weights[:1000])  # a copy that stopped midway
    (truncated / "optimizer.safetensors").write_bytes(weights)
    meta = {"format": "cotrain-checkpoint/1", "step": 5, "config": {}, "tokenizer_hash": "0" * 64,
            "optimizer": {"param_groups": [], "scalars": {}}, "scheduler": None, "files": files}  # fmt: skip
    (truncated / "checkpoint.json").write_text(json.dumps(meta))
    ro = root / "readonly"
    ro.mkdir()
    mounted = _mount_read_only(ro)
    values = {"ws": str(root), "ro": str(ro) if mounted else "", "data": "", "corrupt": ""}
    if data is not None:
        values["data"] = str(data)
        corrupt = root / "corrupt-data"
        shutil.copytree(data, corrupt)
        shard = next((corrupt / "train").glob("*.parquet"))
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2 : len(raw) // 2 + 64] = bytes(64)  # 64 zero bytes in the middle: bit rot
        shard.write_bytes(bytes(raw))
        values["corrupt"] = str(corrupt)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    values["port"] = str(busy.getsockname()[1])
    try:
        yield values
    finally:
        busy.close()
        if mounted and os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], capture_output=True)
        else:
            ro.chmod(0o755)


def fill(argv: list[str], values: dict[str, str]) -> list[str]:
    return [a.format(**values) for a in argv]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def shown_lines(text: str) -> list[str]:
    """Non-empty lines of the output, without progress bars (lines redrawn with carriage returns)."""
    return [line for line in text.split("\n") if line.strip() and "\r" not in line]


def call(argv: list[str]) -> tuple[int, str]:
    """`cotrain ARGV` through its entry function, in this process. An input that passes every check would
    start the role's processes: that fails the row at once instead."""
    from cotrain.cli import main
    from cotrain.host import procs

    def accepted(argv: list[str]) -> int:
        raise AssertionError(f"the input was accepted: cotrain {' '.join(argv)} would start")

    out, err = io.StringIO(), io.StringIO()
    real, procs.supervise = procs.supervise, accepted
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        procs.supervise = real
    return rc, out.getvalue() + err.getvalue()


def run_process(argv: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "cotrain", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**cotrain_env(), "COTRAIN_LOG_COLOR": "0"},
        cwd=cwd,
    )
    return done.returncode, done.stdout + done.stderr


def check_call_case(argv: list[str], expected: str, root: Path) -> str:
    """Run one in-process row and check it; returns its one line."""
    before = tree(root)
    rc, output = call(argv)
    lines = shown_lines(output)
    assert rc != 0 and "Traceback" not in output, output
    assert len(lines) == 1 and lines[0].startswith("cotrain") and ": error: " in lines[0], output
    assert expected in lines[0], (expected, output)
    assert tree(root) == before, "a file or folder was left behind"
    return lines[0]


def check_process_case(argv: list[str], expected: str, root: Path) -> tuple[int, str]:
    """Run one row as a real `cotrain` process; the last line is the one error line, nothing else errs."""
    rc, output = run_process(argv, root)
    lines = shown_lines(output)
    errors = [line for line in lines if ": error: " in line]
    assert rc != 0 and "Traceback" not in output, output
    assert lines and lines[-1].startswith("cotrain train: error: ") and expected in lines[-1], output
    assert errors == [lines[-1]], output
    return rc, lines[-1]


@pytest.fixture(scope="module")
def calls_workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    with workspace(root) as values:
        yield values


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "expected"), [pytest.param(*c[1:3], id=c[0]) for c in CASES if c[3] == "call"]
)
def test_bad_input_in_process(argv, expected, calls_workspace, monkeypatch):
    if "{ro}" in " ".join(argv) and not calls_workspace["ro"]:
        pytest.skip("no read-only folder can be made here (root without mount)")
    root = Path(calls_workspace["ws"])
    monkeypatch.chdir(root)
    check_call_case(fill(argv, calls_workspace), expected, root)


@pytest.fixture(scope="module")
def process_workspace(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("bad-input-processes")
    with workspace(root, demo_data) as values:
        yield values


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("argv", "expected"), [pytest.param(*c[1:3], id=c[0]) for c in CASES if c[3] == "process"]
)
def test_bad_input_in_a_process(argv, expected, process_workspace):
    check_process_case(fill(argv, process_workspace), expected, Path(process_workspace["ws"]))


def test_the_table_is_large_enough():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


def markdown_table() -> str:
    """Every row run for real, as the Markdown table of docs/reliability.md."""
    from cotrain.data import prepare_from_source

    rows = ["| input | command | exit code | the one line | seconds |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        prepare_from_source(
            demo=True, text_files=None, out_dir=data, max_length=128, seed=0, tokenizer_path=None,
            vocab_size=4000, progress=False,
        )  # fmt: skip
        root = Path(tmp) / "ws"
        root.mkdir()
        os.chdir(root)
        with workspace(root, data) as values:
            for what, argv, expected, how in CASES:
                argv = fill(argv, values)
                t = time.monotonic()
                if how == "call":
                    rc, output = call(argv)
                else:
                    rc, output = run_process(argv, root)
                lines = shown_lines(output)
                line = lines[-1] if lines else ""
                shown = " ".join(argv).replace(tmp, "$TMP").replace("|", "\\|")
                line = line.replace(tmp, "$TMP").replace("|", "\\|")
                ok = rc != 0 and expected in line and "Traceback" not in output
                rows.append(
                    f"| {what}{'' if ok else ' (FAILED)'} | `cotrain {shown}` | {rc} | {line} | "
                    f"{time.monotonic() - t:.1f} |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
