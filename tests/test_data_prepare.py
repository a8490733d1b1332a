"""`cotrain prepare` end to end: WikiText statistics for albert-large-v2, objectives, tokenizer types,
determinism, the held-out split, shards and manifest, sources, and every bad input."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import unicodedata
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import torch

from conftest import LOCALHOST, WIKITEXT, WIKITEXT_IS_REAL, at_least, cotrain_env
from cotrain.cli import main
from cotrain.data import (
    ClmCollator,
    DataError,
    MlmCollator,
    document_split,
    load_tokenizer,
    prepare_dataset,
    prepare_from_source,
    read_manifest,
    read_wikitext,
    train_tokenizer,
)
from cotrain.data.shards import sha256_file
from cotrain.errors import UserError

LARGE_SHARD = at_least(500, 8)  # examples per shard of the albert-large-v2 dataset: at least 3 shards


def normalized(text: str) -> str:
    return "".join(unicodedata.normalize("NFKC", text).lower().split())


def cotrain(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cotrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cotrain_env(),
    )


def rows(root: Path, manifest: dict, split: str = "train") -> list[dict]:
    return [r for e in manifest["shards"][split] for r in pq.read_table(root / e["path"]).to_pylist()]


@pytest.fixture(scope="module")
def wiki_docs() -> list[str]:
    return list(itertools.islice(read_wikitext(WIKITEXT), 400))


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


@pytest.mark.parametrize("kind", ["unigram", "wordpiece", "bpe"])
def test_tokenizer_training_per_type(kind: str, wiki_docs: list[str], tmp_path: Path) -> None:
    tokenizer = train_tokenizer(wiki_docs, kind, 1500, tmp_path / "tok")
    assert 1000 < len(tokenizer) <= 1500
    loaded = load_tokenizer(tmp_path / "tok", "mlm" if kind != "bpe" else "clm")
    text = "The European lobster is a species of lobster."
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert normalized(loaded.decode(ids)) == normalized(text)
    assert loaded.unk_token_id not in ids
    for name in ("cls_token_id", "sep_token_id", "mask_token_id", "pad_token_id", "eos_token_id"):
        assert getattr(loaded, name) is not None
    with pytest.raises(DataError, match="unknown tokenizer type"):
        train_tokenizer(wiki_docs, "sentencepiece", 1000, tmp_path / "x")


def test_objectives_mlm_and_clm(wiki_docs: list[str], tmp_path: Path) -> None:
    mlm = prepare_dataset(wiki_docs[:150], tmp_path / "mlm", max_length=64, objective="mlm", vocab_size=1500)
    assert mlm["tokenizer"]["type"] == "wordpiece" and mlm["columns"] == ["input_ids", "attention_mask",
                                                                          "special_tokens_mask"]  # fmt: skip
    tok = load_tokenizer(tmp_path / "mlm" / "tokenizer", "mlm")
    examples = rows(tmp_path / "mlm", mlm)
    assert all(len(e["input_ids"]) <= 64 and e["input_ids"][0] == tok.cls_token_id for e in examples)
    assert all(e["input_ids"][-1] == tok.sep_token_id for e in examples)
    source = normalized(" ".join(wiki_docs[:150]))
    for e in examples[:40]:
        text = normalized(tok.decode(e["input_ids"], skip_special_tokens=True).replace(" ##", ""))
        assert text.removeprefix("##") in source  # a long sentence may be cut inside a word

    for whole_words in (False, True):
        batch = MlmCollator(tok, seed=1, whole_word_mask=whole_words)(examples[:64])
        assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
        selected = batch["labels"] != -100
        assert 0.08 < selected.sum() / batch["attention_mask"].sum() < 0.25
        if whole_words:  # a word piece is selected exactly when the piece before it in its word is
            pieces = [
                tok.convert_ids_to_tokens(int(i)) for i in torch.where(selected, batch["labels"], 0).flatten()
            ]
            cont = torch.tensor([p.startswith("##") for p in pieces]).view(selected.shape) & selected
            rows_, cols = cont.nonzero(as_tuple=True)
            assert selected[rows_, cols - 1].all()

    clm = prepare_dataset(wiki_docs[:150], tmp_path / "clm", max_length=64, objective="clm", vocab_size=1500)
    assert clm["tokenizer"]["type"] == "bpe" and clm["columns"] == ["input_ids"]
    blocks = rows(tmp_path / "clm", clm)
    assert all(len(b["input_ids"]) == 64 for b in blocks)
    tok = load_tokenizer(tmp_path / "clm" / "tokenizer", "clm")
    train_docs = [d for d in wiki_docs[:150] if document_split(d, 0.02) == "train"]
    stream = [
        t for d in train_docs for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    ]
    assert [t for b in blocks for t in b["input_ids"]] == stream[: len(blocks) * 64]  # contiguous, packed
    batch = ClmCollator(tok)([blocks[0], {"input_ids": blocks[1]["input_ids"][:10]}])
    assert torch.equal(batch["labels"][0], batch["input_ids"][0])
    assert (batch["labels"][1, 10:] == -100).all() and batch["attention_mask"][1].sum() == 10


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


def test_held_out_split_has_no_document_on_both_sides(wiki_docs: list[str], tmp_path: Path) -> None:
    manifest = prepare_dataset(
        wiki_docs[:200], tmp_path / "d", max_length=128, vocab_size=1500, valid_fraction=0.2
    )
    tok = load_tokenizer(tmp_path / "d" / "tokenizer")
    sides = {
        s: [normalized(d) for d in wiki_docs[:200] if document_split(d, 0.2) == s]
        for s in ("train", "validation")
    }
    assert manifest["num_documents"] == {s: len(v) for s, v in sides.items()}
    for split, other in (("train", "validation"), ("validation", "train")):
        for example in rows(tmp_path / "d", manifest, split)[:50]:
            columns = (example["input_ids"], example["token_type_ids"], example["special_tokens_mask"])
            ids = [i for i, t, s in zip(*columns, strict=True) if t == 0 and not s]
            text = normalized(tok.decode(ids))
            assert any(text in d for d in sides[split]) and not any(text in d for d in sides[other])


def test_local_dataset_by_name_and_recipe_data(wiki_docs: list[str], tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    lines = [" = Heading = ", *wiki_docs[:120], ""]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    by_name = prepare_from_source(
        dataset=str(folder), out_dir=tmp_path / "a", max_length=128, vocab_size=1500
    )
    assert by_name["source"]["kind"] == "dataset"
    assert sum(by_name["num_documents"].values()) == len(wiki_docs[:120])
    with pytest.raises(DataError, match="no column 'content'"):
        from cotrain.data.sources import hf_documents

        list(hf_documents(str(folder), "", text_column="content"))

    # data made by the original recipe: a save_to_disk DatasetDict of tokenized SOP examples
    examples = rows(tmp_path / "a", by_name)
    recipe = tmp_path / "recipe"
    splits = {"train": examples[:50], "validation": examples[50:60]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(
        str(recipe)
    )
    with pytest.raises(DataError, match="give the tokenizer it was made with"):
        prepare_from_source(recipe_data=str(recipe), out_dir=tmp_path / "r", max_length=128)
    tok = str(tmp_path / "a" / "tokenizer")
    archive = tmp_path / "recipe.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(recipe, arcname="albert_tokenized_wikitext")
    for source in (str(recipe), str(archive)):
        imported = prepare_from_source(
            recipe_data=source, out_dir=tmp_path / "r", max_length=128, tokenizer_path=tok
        )
        assert imported["num_examples"] == {"train": 50, "validation": 10}
        assert imported["tokenizer"]["note"].startswith("tokenized by the original recipe")
        assert rows(tmp_path / "r", imported) == examples[:50]


# --- bad inputs, through the CLI: one clear line, a non-zero exit, nothing written ---------------


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


def test_preparing_again_replaces_a_dataset_folder(wiki_docs: list[str], tmp_path: Path) -> None:
    out = tmp_path / "data"
    out.mkdir()  # an empty folder is used
    first = prepare_dataset(wiki_docs[:60], out, max_length=64, seed=0, vocab_size=800)
    second = prepare_dataset(wiki_docs[:60], out, max_length=64, seed=1, vocab_size=800)
    assert read_manifest(out) == second != first
    assert [f.name for f in tmp_path.iterdir()] == ["data"]
    # a file that `prepare` does not write makes it someone else's folder: refused, nothing touched
    (out / "notes.txt").write_text("the user's")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(UserError, match=r"is not a cotrain dataset \(it holds 'notes.txt'"):
        prepare_dataset(wiki_docs[:60], out, max_length=64, seed=2, vocab_size=800)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before and read_manifest(out) == second


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
