"""Benchmark: `cotrain prepare` versus the original recipe's way of preparing ALBERT data.

The baseline does what the seed's ``tokenize_wikitext103.py`` did, single-process: load the text with
``datasets.load_dataset("text", ...)``, ``map`` a create-instances function over the documents
(the same sentence splitter, tokenizer and SOP pairing as cotrain: ``cotrain.data.albert``), then
``save_to_disk``. cotrain runs ``cotrain prepare --num-proc N``. Both use the same, already trained
tokenizer, on a temporary corpus made of WikiText-2's validation file repeated (5x and 20x), and both
run as child processes whose peak memory (PSS summed over the process tree, sampled every 50 ms) is
recorded.

    python benchmarks/prepare.py [--num-proc 2] [--repeats 5 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
MAX_LENGTH = 512  # albert-large-v2


def baseline(corpus: str, tokenizer_dir: str, out: str, cache: str) -> None:
    """The seed's approach, in this (child) process."""
    import datasets

    from cotrain.data.albert import document_examples
    from cotrain.data.corpus import _is_wikitext_heading
    from cotrain.data.tokenizer import load_tokenizer

    datasets.disable_progress_bars()
    tokenizer = load_tokenizer(tokenizer_dir)
    text = datasets.load_dataset("text", data_files=corpus, split="train", cache_dir=cache)

    def create_instances(batch: dict) -> dict:
        out: dict[str, list] = {k: [] for k in ("input_ids", "token_type_ids", "attention_mask",
                                                "special_tokens_mask", "sentence_order_label")}  # fmt: skip
        for line in batch["text"]:
            document = line.strip()
            if not document or _is_wikitext_heading(document):
                continue
            for example in document_examples(document, tokenizer, MAX_LENGTH, seed=0):
                for key, value in example.items():
                    out[key].append(value)
        return out

    examples = text.map(create_instances, batched=True, remove_columns=["text"])
    examples.save_to_disk(out)
    tokens = sum(len(ids) for ids in examples["input_ids"])
    print(json.dumps({"examples": len(examples), "tokens": tokens}))


def measure(cmd: list[str]) -> tuple[float, float, str]:
    """Run ``cmd``; return (seconds, peak PSS of its process tree in MiB, stdout)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                # PSS: pages shared by forked workers are counted once, split between them
                peak = max(peak, sum(p.memory_full_info().pss for p in procs if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return seconds, peak / 2**20, stdout


def baseline_command(corpus: Path, tokenizer: Path, out: Path, cache: Path) -> list[str]:
    """The original recipe's preparation of ``corpus``: this script with ``--baseline``."""
    return [sys.executable, __file__, "--baseline", str(corpus), str(tokenizer), str(out), str(cache)]


def cotrain_command(corpus: Path, tokenizer: Path, out: Path, num_proc: int) -> list[str]:
    """`cotrain prepare` of ``corpus`` for albert-large-v2 with the same tokenizer."""
    return [sys.executable, "-m", "cotrain", "prepare", "--preset", "albert-large-v2", "--text-files",
            str(corpus), "--tokenizer", str(tokenizer), "--output", str(out), "--num-proc",
            str(num_proc)]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--repeats", type=int, nargs="+", default=[5, 20])
    parser.add_argument(
        "--baseline", nargs=4, metavar=("CORPUS", "TOKENIZER", "OUT", "CACHE"), help="internal"
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline:
        baseline(*args.baseline)
        return
    if not WIKITEXT.is_file():
        raise SystemExit(f"{WIKITEXT} is not available")
    from cotrain.data import read_wikitext, train_albert_tokenizer

    rows = []
    with tempfile.TemporaryDirectory(prefix="cotrain-bench-") as tmp:
        tmp_path = Path(tmp)
        tokenizer = tmp_path / "tokenizer"
        train_albert_tokenizer(read_wikitext(WIKITEXT), 8000, tokenizer)
        text = WIKITEXT.read_text(encoding="utf-8")
        for repeats in args.repeats:
            corpus = tmp_path / f"wikitext-x{repeats}.txt"
            corpus.write_text(text * repeats, encoding="utf-8")
            mb = corpus.stat().st_size / 1e6
            out = tmp_path / f"base-{repeats}"
            cache = tmp_path / f"hf-cache-{repeats}"
            t_base, m_base, stdout = measure(baseline_command(corpus, tokenizer, out, cache))
            tokens = json.loads(stdout.strip().splitlines()[-1])["tokens"]
            out = tmp_path / f"cotrain-{repeats}"
            t_ours, m_ours, _ = measure(cotrain_command(corpus, tokenizer, out, args.num_proc))
            manifest = json.loads((out / "manifest.json").read_text())
            ours_tokens = sum(manifest["num_tokens"].values())
            rows.append((repeats, mb, tokens, t_base, m_base, ours_tokens, t_ours, m_ours))
    cpu = platform.processor() or platform.machine()
    print(f"machine: {os.cpu_count()} CPUs, {cpu}; num_proc={args.num_proc}")
    header = ("corpus", "MB", "baseline tok/s", "baseline peak MiB",
              f"cotrain (num_proc {args.num_proc}) tok/s", "cotrain peak MiB", "speed-up")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for repeats, mb, tokens, t_base, m_base, ours_tokens, t_ours, m_ours in rows:
        assert ours_tokens == tokens, (ours_tokens, tokens)  # the same examples
        speed_base, speed_ours = tokens / t_base, ours_tokens / t_ours
        print(f"| valid.txt x{repeats} | {mb:.1f} | {speed_base:,.0f} | {m_base:.0f} | {speed_ours:,.0f} | "
              f"{m_ours:.0f} | {speed_ours / speed_base:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
