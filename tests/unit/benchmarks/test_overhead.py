"""The overhead benchmark's arms: WikiText's articles as whole documents, and the peer arm given the plain
loop's model, precision and batches."""

from __future__ import annotations

import argparse
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import overhead  # noqa: E402


def test_whole_articles_join_each_wikitext_articles_paragraphs_into_one_document(tmp_path):
    source = tmp_path / "wiki.txt"
    source.write_text(
        " \n = First = \n \n First paragraph . \n \n = = Section = = \n \n Second paragraph . \n"
        " \n = Second = \n \n Third paragraph . \n",
        encoding="utf-8",
    )
    joined = overhead.join_articles(str(source), tmp_path / "articles.txt").read_text(encoding="utf-8")
    assert joined.split("\n\n") == [
        "First paragraph . Second paragraph .",
        "Third paragraph .\n",
    ]


def test_the_peer_arm_gets_the_same_model_precision_and_batches_as_the_plain_loop(tmp_path):
    args = argparse.Namespace(
        preset="albert-large-v2", threads=8, micro_batch=32, steps=4, accumulation=4, device="cuda",
        precision="bf16", target_batch_size=1024, cotrain_args=["--verbose"],
    )  # fmt: skip
    cmd = overhead.cotrain_command(args, tmp_path / "data", tmp_path / "out", "r1")
    flags = " ".join(cmd[cmd.index("train") + 1 :])
    for expected in (
        "--preset albert-large-v2",
        "--per-device-train-batch-size 32",
        "--gradient-accumulation-steps 4",
        "--devices cuda",
        "--bf16",
        "--target-batch-size 1024",
        "--max-steps 4",
        "--torch-threads 8",
    ):
        assert expected in flags
    assert flags.endswith("--verbose")
    assert overhead.run_config(args).target_batch_size == 1024
    args.precision, args.target_batch_size = "fp32", 0
    cmd = overhead.cotrain_command(args, tmp_path / "data", tmp_path / "out", "r1")
    assert "--fp32" not in cmd and "--target-batch-size" not in cmd
    assert overhead.run_config(args).target_batch_size == 4096  # the preset's
