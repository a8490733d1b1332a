"""`cotrain prepare` end to end.

Here, in the test process alone; the rest in tests/live/test_data_prepare.py."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import datasets
import pytest
import torch

from cotrain.data import (
    ClmCollator,
    DataError,
    MlmCollator,
    document_split,
    load_tokenizer,
    prepare_dataset,
    prepare_from_source,
    read_manifest,
    train_tokenizer,
)
from cotrain.errors import UserError
from support.data_prepare import normalized, rows


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
