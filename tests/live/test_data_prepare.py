"""`cotrain prepare` end to end.

Here, with cotrain processes; the rest in tests/unit/data/test_data_prepare.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import LOCALHOST, WIKITEXT, WIKITEXT_IS_REAL, at_least, cotrain_env
from cotrain.cli import main
from cotrain.data import (
    DataError,
    load_tokenizer,
    prepare_dataset,
    read_manifest,
    train_tokenizer,
)
from cotrain.data.shards import sha256_file
from support.data_prepare import normalized, rows

LARGE_SHARD = at_least(500, 8)  # examples per shard of the albert-large-v2 dataset: at least 3 shards


def cotrain(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cotrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cotrain_env(),
    )


@pytest.fixture(scope="module")
def albert_large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """WikiText-2 validation prepared through the CLI as `albert-large-v2` does (512 tokens)."""
    out = tmp_path_factory.mktemp("large") / "data"
    p = cotrain("prepare", "--preset", "albert-large-v2", "--text-files", str(WIKITEXT), "--output", str(out),
                "--num-proc", "2", "--shard-size", str(LARGE_SHARD), "--vocab-size", "8000")  # fmt: skip
    assert p.returncode == 0, p.stderr
    printed = json.loads(p.stdout.strip().splitlines()[-1])
    return out, printed


def test_wikitext_statistics_for_albert_large(albert_large: tuple[Path, dict]) -> None:
    out, printed = albert_large
    manifest = read_manifest(out)
    stats = {k: manifest[k] for k in ("num_examples", "mean_tokens_per_example", "sop_swapped_fraction")}
    print("WikiText-2 valid.txt for albert-large-v2:", json.dumps(stats))
    assert {k: printed[k] for k in stats} == stats  # printed by the CLI and recorded in the manifest
    assert manifest["max_length"] == 512 and manifest["objective"] == "sop+mlm"
    assert manifest["num_examples"]["train"] > at_least(1000, 20) and manifest["num_examples"]["validation"]
    assert 100 < manifest["mean_tokens_per_example"] <= 512
    assert abs(manifest["sop_swapped_fraction"] - 0.5) <= (0.04 if WIKITEXT_IS_REAL else 0.15)  # binomial
    assert printed["num_shards"]["train"] == len(manifest["shards"]["train"]) >= 3
    for split in ("train", "validation"):
        for entry in manifest["shards"][split]:
            path = out / entry["path"]
            assert entry["num_examples"] <= LARGE_SHARD and entry["bytes"] == path.stat().st_size
            assert entry["sha256"] == sha256_file(path)
    assert (
        manifest["tokenizer"]["type"] == "unigram"
        and manifest["tokenizer"]["hash"] == manifest["tokenizer_hash"]
    )
    assert set(manifest["tokenizer"]["files"]) == {p.name for p in (out / "tokenizer").iterdir()}
    assert manifest["config"]["num_proc"] == 2 and manifest["source"]["files"] == [str(WIKITEXT)]

    tokenizer = load_tokenizer(out / "tokenizer")
    source = normalized(WIKITEXT.read_text(encoding="utf-8"))
    examples = rows(out, manifest)
    for example in examples[:: max(1, len(examples) // 150)]:
        assert len(example["input_ids"]) <= 512
        ids, types, special = example["input_ids"], example["token_type_ids"], example["special_tokens_mask"]
        for segment in (0, 1):
            text = tokenizer.decode(
                [i for i, t, s in zip(ids, types, special, strict=True) if t == segment and not s]
            )
            assert normalized(text) and normalized(text) in source, text


def test_bad_inputs_are_one_clear_error(
    wiki_docs: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 au lait. Tr\u00e8s bon.\n".encode("latin-1"))
    (tmp_path / "one.txt").write_text("Only sentence here.\n")
    train_tokenizer(wiki_docs[:50], "bpe", 600, tmp_path / "bpe")
    bpe_without_mask = load_tokenizer(tmp_path / "bpe", "clm")
    bpe_without_mask.mask_token = None
    bpe_without_mask.save_pretrained(str(tmp_path / "nomask"))
    cases = [
        (["--text-files", str(tmp_path / "missing.txt")], "text file not found"),
        (["--text-files", str(tmp_path / "empty.txt")], "no text in"),
        (["--text-files", str(tmp_path / "latin1.txt")], "is not UTF-8"),
        (["--text-files", str(tmp_path / "one.txt")], "at least two sentences"),
        (["--text-files", str(WIKITEXT), "--tokenizer", str(tmp_path / "nomask")], "lacks mask_token"),
        (["--text-files", str(WIKITEXT), "--objective", "xlnet"], "objective must be one of"),
        ([], "no corpus"),
    ]
    for i, (args, message) in enumerate(cases):
        argv = ["prepare", "--preset", "albert-tiny", "--output", str(tmp_path / "out"), *args]
        if i < 2:  # as a user runs it: a process with an exit code
            p = cotrain(*argv)
            rc, err = p.returncode, p.stderr
        else:  # the same entry point in this process (faster)
            capsys.readouterr()
            rc = main(argv)
            err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc != 0 and message in lines[-1] and "Traceback" not in err, (args, err)
        assert lines[-1].startswith("cotrain prepare: error:")
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_prepare_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("a user's file")
    p = cotrain("prepare", "--demo-corpus", "--preset", "albert-tiny", "--output", str(out))
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("cotrain prepare: error:") and "not a cotrain dataset" in lines[0]
    assert [f.name for f in out.iterdir()] == ["thesis.tex"]
    assert (out / "thesis.tex").read_text() == "a user's file"
    assert [f.name for f in tmp_path.iterdir()] == ["mine"]  # no temp folder either
    (tmp_path / "file").write_text("not a folder")
    p = cotrain("prepare", "--demo-corpus", "--preset", "albert-tiny", "--output", str(tmp_path / "file"))
    assert p.returncode == 2 and "is not a folder" in p.stderr
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.slow  # several seconds: the full suite runs it, not the daily "not slow" run
def test_dataset_for_another_objective_is_refused_by_the_trainer(
    wiki_docs: list[str], tmp_path: Path
) -> None:
    prepare_dataset(wiki_docs[:100], tmp_path / "clm", max_length=64, objective="clm", vocab_size=800)
    p = cotrain(
        "train",
        "--preset",
        "albert-tiny",
        "--host-maddrs",
        LOCALHOST,
        "--dataset-path",
        str(tmp_path / "clm"),
    )
    lines = [line for line in (p.stderr + p.stdout).splitlines() if line.strip()]
    assert (
        p.returncode != 0 and "was prepared for 'clm', but preset albert-tiny trains 'sop+mlm'" in lines[-1]
    )


@pytest.mark.timeout(120)
def test_interrupted_prepare_leaves_no_dataset(tmp_path: Path) -> None:
    corpus = tmp_path / "big.txt"
    corpus.write_text(WIKITEXT.read_text(encoding="utf-8") * 3, encoding="utf-8")
    out = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cotrain", "prepare", "--text-files", str(corpus), "--output", str(out)],
        env=cotrain_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".data.tmp-*/tokenizer")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up
    proc.wait(timeout=10)
    assert not out.exists()
    with pytest.raises(DataError, match="run `cotrain prepare` first"):
        read_manifest(out)
    leftovers = list(tmp_path.glob(".data.tmp-*"))
    assert leftovers and not (leftovers[0] / "manifest.json").exists()  # never taken for a finished one


def test_determinism_and_num_proc_do_not_change_the_output(wiki_docs: list[str], tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    train_tokenizer(wiki_docs, "unigram", 1500, tok_dir)
    runs = {}
    for name, seed, num_proc in (("a", 3, 1), ("b", 3, 2), ("c", 4, 1)):
        runs[name] = prepare_dataset(
            wiki_docs, tmp_path / name, max_length=128, seed=seed, shard_size=100,
            tokenizer_path=str(tok_dir), num_proc=num_proc, valid_fraction=0.1,
        )  # fmt: skip
    assert runs["a"]["shards"] == runs["b"]["shards"]  # byte-identical shards, whatever num_proc
    assert runs["a"]["shards"] != runs["c"]["shards"]  # another seed, other pairs
