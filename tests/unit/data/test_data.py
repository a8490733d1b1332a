"""Tests of cotrain.data.

Here, in the test process alone; the rest in tests/live/test_data.py."""

from __future__ import annotations

import itertools
import json
import shutil
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from conftest import WIKITEXT, at_least
from cotrain.data import (
    EXAMPLE_COLUMNS,
    AlbertCollator,
    DataError,
    build_sop_examples,
    demo_corpus,
    document_split,
    load_prepared,
    load_tokenizer,
    prepare_dataset,
    prepare_from_source,
    read_manifest,
    read_text_files,
    read_wikitext,
    split_sentences,
    tokenizer_hash,
    train_albert_tokenizer,
)
from cotrain.errors import UserError

MAX_LENGTH = 128


def normalized(text: str) -> str:
    """What the tokenizer keeps of a text, without whitespace: NFKC, lowercase."""
    return "".join(unicodedata.normalize("NFKC", text).lower().split())


@pytest.fixture(scope="module")
def wikitext_path() -> Path:
    return WIKITEXT


@pytest.fixture(scope="module")
def wiki_docs(wikitext_path: Path) -> list[str]:
    return list(itertools.islice(read_wikitext(wikitext_path), 300))


@pytest.fixture(scope="module")
def tokenizer(wikitext_path: Path, tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """Trained on the whole WikiText-2 validation file (about 1 MB)."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    return train_albert_tokenizer(read_wikitext(wikitext_path), vocab_size=4000, out_dir=out)


@pytest.fixture(scope="module")
def prepared(wiki_docs: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("prep") / "data"
    manifest = prepare_dataset(
        wiki_docs[:200], out, max_length=MAX_LENGTH, seed=3, vocab_size=2000, valid_fraction=0.2
    )
    return out, manifest


def segments(example: dict, tokenizer: PreTrainedTokenizerFast) -> tuple[str, str]:
    ids = list(example["input_ids"])
    types = list(example["token_type_ids"])
    special = list(example["special_tokens_mask"])
    a = [i for i, t, s in zip(ids, types, special, strict=True) if t == 0 and not s]
    b = [i for i, t, s in zip(ids, types, special, strict=True) if t == 1 and not s]
    return tokenizer.decode(a), tokenizer.decode(b)


def test_demo_corpus_is_large_clean_and_deterministic() -> None:
    docs = demo_corpus()
    assert len(docs) > 1000
    assert sum(map(len, docs)) >= 300_000
    assert all(len(d) >= 40 and d == " ".join(d.split()) for d in docs)
    assert not any(">>>" in d or "::=" in d for d in docs)
    assert len(set(docs)) == len(docs)
    assert demo_corpus() == docs
    assert sum(len(split_sentences(d)) >= 2 for d in docs) > 500  # enough material for SOP


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Mr. Smith went to Washington. He arrived.", "Mr. Smith went to Washington. | He arrived."),
        ("Dr. Jones met J. R. R. Tolkien. They talked.", "Dr. Jones met J. R. R. Tolkien. | They talked."),
        ("Use a tool, e.g. A hammer. Or i.e. This one.", "Use a tool, e.g. A hammer. | Or i.e. This one."),
        ("In the U.S. Army in 1990. Then he quit.", "In the U.S. Army in 1990. | Then he quit."),
        ("St. Louis is big. It is in Missouri.", "St. Louis is big. | It is in Missouri."),
        ("It weighs 0 @.@ 7 kg . The claws are 1 @.@ 5 cm . Wow !", "It weighs 0 @.@ 7 kg . | The claws are "
         "1 @.@ 5 cm . | Wow !"),
        ("the lobster , H. americanus . It may grow", "the lobster , H. americanus . | It may grow"),
        ('He said "Stop." Then he left.', 'He said "Stop." | Then he left.'),
        ('He said " Stop . " Then he left . "', 'He said " Stop . " | Then he left . "'),
        ("Is it? Yes! It is 3.14 exactly.", "Is it? | Yes! | It is 3.14 exactly."),
        ("Born in 1990. 2000 was the year he moved.", "Born in 1990. | 2000 was the year he moved."),
        ("no split here. because lowercase follows", "no split here. because lowercase follows"),
        ("  spaced\n out.   Next\tone. ", "spaced out. | Next one."),
        ("The <unk> fled . <unk> followed .", "The <unk> fled . | <unk> followed ."),
    ],
)  # fmt: skip
def test_split_sentences(text: str, expected: str) -> None:
    assert split_sentences(text) == expected.split(" | ")
    assert split_sentences("") == split_sentences("  \n ") == []


def test_read_wikitext_skips_headings(tmp_path: Path) -> None:
    path = tmp_path / "wiki.txt"
    path.write_text(
        " \n = Title = \n \n First para . Two .\n \n = = Sub = = \n Second para .\n = = = Deep = = = \n"
    )
    assert list(read_wikitext(path)) == ["First para . Two .", "Second para ."]


def test_wikitext_articles_join_each_articles_paragraphs(tmp_path: Path) -> None:
    from cotrain.data.corpus import wikitext_articles

    path = tmp_path / "wiki.txt"
    path.write_text(
        " \n = One = \n \n First para .\n \n = = Sub = = \n Second para .\n = Two = \n Third para .\n"
    )
    assert list(wikitext_articles(path)) == ["First para . Second para .", "Third para ."]


def test_read_wikitext_real_file(wikitext_path: Path, wiki_docs: list[str]) -> None:
    lines = [line.strip() for line in wikitext_path.read_text(encoding="utf-8").splitlines()]
    first_paragraph = next(line for line in lines if line and not line.startswith("="))
    assert wiki_docs[0] == first_paragraph
    assert not any(d.startswith("= ") and d.endswith(" =") for d in wiki_docs)


def test_read_text_files_plain_glob_and_wikitext(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("First line\nsame paragraph.\n\n\nSecond   paragraph.\n")
    (tmp_path / "b.txt").write_text("Third paragraph.")
    (tmp_path / "w.raw").write_text(" = Head = \n Wiki para one .\n \n = = Sub = = \n Wiki para two .\n")
    docs = list(read_text_files([str(tmp_path / "*.txt"), str(tmp_path / "w.raw")]))
    assert docs == [
        "First line same paragraph.",
        "Second paragraph.",
        "Third paragraph.",
        "Wiki para one .",
        "Wiki para two .",
    ]


def test_missing_and_empty_corpus_raise_data_error(tmp_path: Path) -> None:
    assert issubclass(DataError, UserError)
    with pytest.raises(DataError, match="not found"):
        read_wikitext(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="not found"):
        read_text_files([str(tmp_path / "missing.txt")])
    with pytest.raises(DataError, match="no file matches"):
        read_text_files([str(tmp_path / "*.nothing")])
    (tmp_path / "empty.txt").write_text("\n  \n\n")
    with pytest.raises(DataError, match="no text"):
        list(read_text_files([str(tmp_path / "empty.txt")]))
    with pytest.raises(DataError, match="empty"):
        prepare_dataset([], tmp_path / "out", max_length=MAX_LENGTH)
    with pytest.raises(DataError, match="empty"):
        prepare_dataset(["   ", ""], tmp_path / "out", max_length=MAX_LENGTH)
    with pytest.raises(DataError, match="two sentences"):
        prepare_dataset(["Just one sentence here."] * 20, tmp_path / "out", max_length=MAX_LENGTH)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["empty.txt"]  # no temp folders left


def test_undecodable_bytes_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("Good text.\n\nCaf\u00e9 au lait.\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin1.txt is not UTF-8"):
        list(read_text_files([str(path)]))


def test_prepare_from_source_needs_exactly_one_corpus(tmp_path: Path) -> None:
    for demo, files in ((True, ["x.txt"]), (False, None), (False, [])):
        with pytest.raises(DataError):
            prepare_from_source(
                demo=demo, text_files=files, out_dir=tmp_path / "o", max_length=64, seed=0,
                tokenizer_path=None, vocab_size=1000, progress=False,
            )  # fmt: skip


def test_load_prepared_reports_missing_parts(prepared: tuple[Path, dict], tmp_path: Path) -> None:
    with pytest.raises(DataError, match="run `cotrain prepare` first"):
        load_prepared(tmp_path / "nothing")
    (tmp_path / "no_manifest").mkdir()
    with pytest.raises(DataError, match="manifest"):
        load_prepared(tmp_path / "no_manifest")
    (tmp_path / "no_manifest" / "manifest.json").write_text('{"format_version": 99}')
    with pytest.raises(DataError, match="version 99"):
        load_prepared(tmp_path / "no_manifest")
    broken = tmp_path / "broken"
    shutil.copytree(prepared[0], broken)
    shutil.rmtree(broken / "validation")
    with pytest.raises(DataError, match="lacks shard validation/00000.parquet"):
        load_prepared(broken)


def test_tokenizer_without_mask_is_rejected(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    bad = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>", pad_token="<pad>"
    )
    bad.save_pretrained(str(tmp_path / "bad"))
    with pytest.raises(DataError, match="mask_token"):
        load_tokenizer(tmp_path / "bad")
    with pytest.raises(DataError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "bad" / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(DataError, match="cannot load tokenizer"):
        load_tokenizer(tmp_path / "bad")


def test_tokenizer_has_albert_layout(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]")}
    assert ids == {"<pad>": 0, "<unk>": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.mask_token_id) == (0, 1, 4)
    assert (tokenizer.cls_token_id, tokenizer.sep_token_id) == (2, 3)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("[CLS]", "[SEP]")
    assert at_least(3000, 1000) < len(tokenizer) <= 4000
    assert tokenizer.model_max_length >= 100_000
    pair = tokenizer("The lobster is blue.", "It turns red.", return_special_tokens_mask=True)
    n_b = len(tokenizer("It turns red.", add_special_tokens=False)["input_ids"]) + 1
    assert pair["input_ids"][0] == 2 and pair["input_ids"][-1] == 3
    assert pair["token_type_ids"] == [0] * (len(pair["input_ids"]) - n_b) + [1] * n_b
    assert sum(pair["special_tokens_mask"]) == 3


def test_tokenizer_round_trips_text(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "The European Lobster is a species of lobster from the eastern Atlantic Ocean."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text.lower()


def test_tokenizer_saved_loaded_and_hashed(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tokenizer.save_pretrained(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    a, b = load_tokenizer(tmp_path / "a"), load_tokenizer(tmp_path / "elsewhere")
    assert tokenizer_hash(a) == tokenizer_hash(b) == tokenizer_hash(tokenizer)
    a("some text to truncate", truncation=True, max_length=3)  # transient settings do not count
    assert tokenizer_hash(a) == tokenizer_hash(tokenizer)
    other = train_albert_tokenizer(
        ["A different corpus entirely."] * 50, vocab_size=40, out_dir=tmp_path / "o"
    )
    assert tokenizer_hash(other) != tokenizer_hash(tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "elsewhere", "o"]  # no temp folder left


def test_sop_examples_are_adjacent_segments_of_their_document(
    wiki_docs: list[str], tokenizer: PreTrainedTokenizerFast
) -> None:
    n_examples = 0
    for doc in wiki_docs[:150]:
        source = normalized(doc)
        for example in build_sop_examples([doc], tokenizer, MAX_LENGTH, seed=0):
            n_examples += 1
            assert set(example) == set(EXAMPLE_COLUMNS)
            ids = example["input_ids"]
            assert len(ids) <= MAX_LENGTH
            assert len(example["attention_mask"]) == len(ids) and all(example["attention_mask"])
            assert [i for i, s in zip(ids, example["special_tokens_mask"], strict=True) if s] == [2, 3, 3]
            assert ids[0] == 2 and ids[-1] == 3
            a, b = (normalized(s) for s in segments(example, tokenizer))
            assert a and b
            first, second = (b, a) if example["sentence_order_label"] else (a, b)
            assert first + second in source, (first, second, doc)
    assert n_examples > at_least(100, 60)


def test_sop_labels_are_balanced_and_seeded(wiki_docs: list[str], tokenizer: PreTrainedTokenizerFast) -> None:
    examples = list(build_sop_examples(wiki_docs, tokenizer, MAX_LENGTH, seed=0))
    assert len(examples) >= at_least(300, 60)
    swapped = sum(e["sentence_order_label"] for e in examples) / len(examples)
    assert 0.4 <= swapped <= 0.6
    assert list(build_sop_examples(wiki_docs, tokenizer, MAX_LENGTH, seed=0)) == examples
    other = list(build_sop_examples(wiki_docs, tokenizer, MAX_LENGTH, seed=1))
    assert other != examples
    assert [e["sentence_order_label"] for e in other] != [e["sentence_order_label"] for e in examples]


def test_sop_handles_short_max_length_and_long_sentences(
    wiki_docs: list[str], tokenizer: PreTrainedTokenizerFast
) -> None:
    long_doc = max(wiki_docs[:100], key=len)
    examples = list(build_sop_examples([long_doc], tokenizer, 24, seed=0))
    assert examples and all(len(e["input_ids"]) <= 24 for e in examples)
    with pytest.raises(DataError):
        list(build_sop_examples([long_doc], tokenizer, 4, seed=0))
    single = "A sentence that runs on " + "and on " * 200 + "forever. Then it stops."
    ex = list(build_sop_examples([single], tokenizer, 32, seed=0))
    assert len(ex) > 10 and all(len(e["input_ids"]) <= 32 for e in ex)


def test_document_split_is_a_function_of_the_text() -> None:
    docs = [f"Document number {i}. It has two sentences." for i in range(3000)]
    sides = [document_split(d, 0.1) for d in docs]
    assert sides == [document_split(d, 0.1) for d in docs]
    assert 0.07 < sides.count("validation") / len(docs) < 0.13
    assert all(document_split(d, 0.0) == "train" for d in docs[:100])


def test_prepare_writes_manifest_and_loads_back(prepared: tuple[Path, dict], wiki_docs: list[str]) -> None:
    out, manifest = prepared
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "tokenizer", "train", "validation"]
    assert [p.name for p in out.parent.iterdir()] == ["data"]  # no temp folders beside it
    assert json.loads((out / "manifest.json").read_text()) == manifest == read_manifest(out)
    assert manifest["objective"] == "sop+mlm" and manifest["format_version"] == 2
    assert (manifest["max_length"], manifest["seed"]) == (MAX_LENGTH, 3)
    assert manifest["num_examples"]["train"] > at_least(100, 40)
    assert manifest["num_examples"]["validation"] > 5
    assert sum(manifest["num_documents"].values()) == min(200, len(wiki_docs))
    assert 20 < manifest["mean_tokens_per_example"] <= MAX_LENGTH
    assert 0.3 < manifest["sop_swapped_fraction"] < 0.7

    data = load_prepared(out)
    assert len(data.train) == manifest["num_examples"]["train"]
    assert len(data.validation) == manifest["num_examples"]["validation"]
    assert manifest["vocab_size"] == len(data.tokenizer) <= 2000
    assert manifest["tokenizer_hash"] == tokenizer_hash(data.tokenizer)
    row = data.train[0]
    assert set(row) == set(EXAMPLE_COLUMNS)
    assert isinstance(row["input_ids"], torch.Tensor) and row["input_ids"].dtype == torch.long

    # held out by document: every example's text comes from a document of its own split
    docs_by_side = {side: [normalized(d) for d in wiki_docs[:200] if document_split(d, 0.2) == side]
                    for side in ("train", "validation")}  # fmt: skip
    for side, dataset in (("train", data.train), ("validation", data.validation)):
        other = "validation" if side == "train" else "train"
        for example in itertools.islice(dataset, 60):
            a = normalized(segments(example, data.tokenizer)[0])
            assert any(a in d for d in docs_by_side[side])
            assert not any(a in d for d in docs_by_side[other])

    batch = AlbertCollator(data.tokenizer)([data.train[i] for i in range(4)])
    assert batch["input_ids"].shape[0] == 4 and batch["sentence_order_label"].dtype == torch.long


def test_prepare_with_given_tokenizer_and_replace(
    prepared: tuple[Path, dict], wiki_docs: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "data"
    tok_dir = prepared[0] / "tokenizer"
    first = prepare_dataset(wiki_docs[:40], out, max_length=64, tokenizer_path=str(tok_dir), valid_fraction=0)
    assert first["tokenizer_hash"] == prepared[1]["tokenizer_hash"]
    assert first["num_examples"]["validation"] == 0
    assert len(load_prepared(out).validation) == 0
    second = prepare_dataset(wiki_docs[40:80], out, max_length=64, tokenizer_path=str(tok_dir), seed=5)
    assert read_manifest(out) == second != first
    assert [p.name for p in tmp_path.iterdir()] == ["data"]


def test_interrupted_prepare_leaves_nothing(wiki_docs: list[str], tmp_path: Path) -> None:
    def failing() -> Iterator[str]:
        yield from wiki_docs[:30]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(failing(), tmp_path / "data", max_length=64, vocab_size=500)
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "manifest.json").write_text('{"format_version": 2}')  # an earlier dataset
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(failing(), tmp_path / "data", max_length=64, vocab_size=500)
    assert [p.name for p in tmp_path.iterdir()] == ["data"]
    assert (tmp_path / "data" / "manifest.json").read_text() == '{"format_version": 2}'  # untouched


def test_collator_masks_like_bert(wiki_docs: list[str], tokenizer: PreTrainedTokenizerFast) -> None:
    n = at_least(256, 64)
    examples = list(itertools.islice(build_sop_examples(wiki_docs, tokenizer, MAX_LENGTH, seed=0), n))
    collator = AlbertCollator(tokenizer, seed=7)
    batch = collator(examples)
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels", "sentence_order_label"}
    lengths = torch.tensor([len(e["input_ids"]) for e in examples])
    assert batch["input_ids"].shape == (n, int(lengths.max()))
    assert batch["attention_mask"].sum(1).tolist() == lengths.tolist()
    original = torch.full_like(batch["input_ids"], tokenizer.pad_token_id)
    special = torch.ones_like(batch["input_ids"])
    for row, e in enumerate(examples):
        original[row, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        special[row, : len(e["input_ids"])] = torch.tensor(e["special_tokens_mask"])
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id).all()
    assert (batch["token_type_ids"][batch["attention_mask"] == 0] == 0).all()

    selected = batch["labels"] != -100
    assert not (selected & (special == 1)).any()  # never specials or padding
    assert torch.equal(batch["labels"][selected], original[selected])
    assert (batch["input_ids"][~selected] == original[~selected]).all()
    rate = selected.sum() / (special == 0).sum()
    assert 0.13 < rate < 0.17
    masked = (batch["input_ids"] == tokenizer.mask_token_id) & selected
    unchanged = (batch["input_ids"] == original) & selected
    assert 0.75 < masked.sum() / selected.sum() < 0.85
    assert 0.06 < unchanged.sum() / selected.sum() < 0.14
    assert not torch.isin(batch["input_ids"][selected & ~masked], torch.tensor([0, 2, 3])).any()
    assert batch["sentence_order_label"].dtype == torch.long
    assert batch["sentence_order_label"].tolist() == [e["sentence_order_label"] for e in examples]

    again = AlbertCollator(tokenizer, seed=7)(examples)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    assert not torch.equal(AlbertCollator(tokenizer, seed=8)(examples)["labels"], batch["labels"])


def test_collator_pads_to_multiple_and_masks_at_least_one(tokenizer: PreTrainedTokenizerFast) -> None:
    tiny = {"input_ids": [2, 50, 3, 60, 3], "token_type_ids": [0, 0, 0, 1, 1], "attention_mask": [1] * 5,
            "special_tokens_mask": [1, 0, 1, 0, 1], "sentence_order_label": 1}  # fmt: skip
    collator = AlbertCollator(tokenizer, pad_to_multiple_of=8)
    for _ in range(20):
        batch = collator([tiny])
        assert batch["input_ids"].shape == (1, 8)
        assert 1 <= int((batch["labels"] != -100).sum()) <= 2
    with pytest.raises(ValueError):
        AlbertCollator(tokenizer, mlm_probability=0)
