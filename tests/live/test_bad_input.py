"""Bad input, table-driven: every row ends in one clear line, a non-zero exit, no traceback and no file left.

Most rows call the CLI's entry function (`cotrain.cli.main`) in this process; the rows that need the network
layer or a training process start `cotrain` as a user would. ``python tests/live/test_bad_input.py`` runs
every row and prints the table recorded in docs/reliability.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where run as a script
from conftest import cotrain_env  # noqa: E402
from support.bad_input import CASES, CK, TRUNCATED  # noqa: E402


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
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("argv", "expected"), [pytest.param(*c[1:3], id=c[0]) for c in CASES if c[3] == "process"]
)
def test_bad_input_in_a_process(argv, expected, process_workspace):
    check_process_case(fill(argv, process_workspace), expected, Path(process_workspace["ws"]))


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
