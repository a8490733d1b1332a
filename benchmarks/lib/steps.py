"""Training steps of a preset's model on one CPU thread in a fresh process, for the benchmarks that compare
ways of running them side by side (``malloc_threshold.py``, ``masked_head.py``, ``fused_gelu.py``).

A step is a micro-batch of random tokens (``batch`` x ``length``, 15% of them masked, ALBERT's sentence-order
labels included), its loss (``loss``: ``forward_loss``, cotrain's, or ``full``, the model's own forward), its
backward and an Adam step. The process reports its mean seconds per step after ``warmup`` steps, its
largest resident memory after a step (what it holds between steps) and its peak resident memory (``VmHWM``:
what a step needs at its height). ``mmap_threshold`` sets glibc's ``M_MMAP_THRESHOLD`` before torch
allocates anything; ``trim`` calls ``malloc_trim(0)`` after every step; ``unfused_gelu`` gives the model
transformers' own ``gelu_new`` back in place of the fused kernel cotrain builds it with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable

from lib.netns import print_finished, print_started

STEPS = """
import ctypes, json, sys, time
arm = json.loads(sys.argv[1])
libc = ctypes.CDLL("libc.so.6")
if arm.get("mmap_threshold"):
    libc.mallopt(-3, int(arm["mmap_threshold"]))  # M_MMAP_THRESHOLD, before torch allocates anything
import torch
torch.set_num_threads(1)
import cotrain.config as cfg
from cotrain.models import build_model, forward_loss, model_inputs
VOCAB, BATCH, LENGTH = 30000, arm.get("batch", 8), arm.get("length", 128)
model = build_model(cfg.resolve(arm["preset"]).run, vocab_size=VOCAB)
if arm.get("unfused_gelu"):  # transformers' own gelu_new in place of cotrain's fused kernel
    from transformers.activations import NewGELUActivation
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__ == "GELUTanh":
                setattr(module, name, NewGELUActivation())
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(0)
def loss_of(batch):
    if arm.get("loss") == "full":
        return model(**model_inputs(model, batch)).loss
    return forward_loss(model, batch)
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
def step():
    ids = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=gen)
    labels = ids.masked_fill(torch.rand(BATCH, LENGTH, generator=gen) > 0.15, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "token_type_ids": torch.zeros_like(ids),
             "sentence_order_label": torch.zeros(BATCH, dtype=torch.long)}
    loss_of(batch).backward()
    opt.step()
    opt.zero_grad()
    if arm.get("trim"):
        libc.malloc_trim(0)
for _ in range(arm.get("warmup", 3)):
    step()
started, peak = time.perf_counter(), 0.0
for _ in range(arm.get("steps", 25)):
    step()
    peak = max(peak, rss_mib())
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
print(json.dumps({"s_per_step": (time.perf_counter() - started) / arm.get("steps", 25), "rss_mib": peak,
                  "peak_mib": hwm}))
"""


def run_steps(arm: dict) -> dict:
    """One arm's steps in a fresh process: {"s_per_step": ..., "rss_mib": ..., "peak_mib": ...}."""
    out = subprocess.run(
        [sys.executable, "-c", STEPS, json.dumps(arm)],
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate(
    arms: dict[str, dict], repeats: int, run: Callable[[dict], dict] = run_steps
) -> dict[str, dict]:
    """Run every arm ``repeats`` times, their order reversed every other round (so that neither always goes
    first on a machine warming up); returns each arm's means."""
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for round_ in range(repeats):
        for name in list(arms) if round_ % 2 == 0 else list(reversed(arms)):
            got = run(arms[name])
            results[name].append(got)
            print(f"round {round_ + 1}, {name}: {json.dumps(got)}", flush=True)
    return {
        name: {
            "s_per_step": round(statistics.mean(r["s_per_step"] for r in runs), 4),
            "rss_mib": round(statistics.mean(r["rss_mib"] for r in runs)),
            "peak_mib": round(statistics.mean(r["peak_mib"] for r in runs)),
        }
        for name, runs in results.items()
    }


def build_parser(description: str, presets: list[str]) -> argparse.ArgumentParser:
    """The command line of a benchmark that compares step arms per preset (``compare_presets``)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--presets", nargs="+", default=presets)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    return ap


def compare_presets(
    description: str,
    arms: dict[str, dict],
    base: str,
    presets: list[str],
    event: str,
    argv: list[str] | None = None,
) -> None:
    """A benchmark's command line: for each of ``--presets`` (default ``presets``), run the step ``arms``
    (``base`` among them) side by side, print a table per preset and last a JSON line ``{"event": event,
    "batch": ..., "length": ..., "presets": {PRESET: {ARM: ROW}}}``."""
    args = build_parser(description, presets).parse_args(argv)
    started = print_started()
    results = {}
    for preset in args.presets:
        common = {"preset": preset, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
                  "length": args.length}  # fmt: skip
        print(f"\n{preset}, micro-batch {args.batch} x {args.length}", flush=True)
        results[preset] = alternate({name: {**common, **arm} for name, arm in arms.items()}, args.repeats)
        print_table(results[preset], base, heading=preset)
    print_finished(started)
    print(json.dumps({"event": event, "batch": args.batch, "length": args.length, "presets": results}))


def print_table(summary: dict[str, dict], base: str, heading: str = "setting") -> None:
    """Seconds per step, their ratio to ``base``'s, resident memory between steps and at the peak, one row per
    arm."""
    width = max(11, len(base) + 4)
    print(f"\n{heading:<34}{'s/step':>8}{'x ' + base:>{width}}{'RSS MiB':>9}{'peak MiB':>10}")
    for name, row in summary.items():
        ratio = row["s_per_step"] / summary[base]["s_per_step"]
        print(
            f"{name:<34}{row['s_per_step']:>8.3f}{ratio:>{width}.2f}{row['rss_mib']:>9}{row['peak_mib']:>10}"
        )
