"""What glibc's malloc threshold costs a CPU trainer: step time against resident memory, side by side.

glibc gives a block of ``M_MMAP_THRESHOLD`` bytes or more a mapping of its own, returned to the system when
freed; by default it raises that threshold to the largest such block freed so far (up to 32 MB), so a training
step's activations come from the heap, which keeps its high-water mark. This runs training steps of a preset's
model (random tokens, 15% of them masked, one CPU thread) in a fresh process per setting, the settings
alternating over ``--repeats`` rounds: glibc's default; a fixed threshold of 128 KiB (what
``MALLOC_MMAP_THRESHOLD_=131072`` sets); the default with ``malloc_trim(0)`` after every step. Each process
reports its mean seconds per step (after ``--warmup`` steps) and its largest RSS after a step.

    python benchmarks/malloc_threshold.py [--preset albert-tiny] [--steps 25] [--repeats 2]

Last line: ``{"event": "malloc_threshold_summary", "settings": {NAME: {"s_per_step": ..., "rss_mib": ...}}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import print_finished, print_started  # noqa: E402

SETTINGS = {"glibc default": None, "threshold 128 KiB": 131072, "default + malloc_trim": "trim"}

STEPS = """
import ctypes, json, sys, time
preset, setting, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
libc = ctypes.CDLL("libc.so.6")
if setting.isdigit():
    libc.mallopt(-3, int(setting))  # M_MMAP_THRESHOLD, before torch allocates anything
import torch
torch.set_num_threads(1)
import cotrain.config as cfg
from cotrain.models import build_model, forward_loss
VOCAB, BATCH, LENGTH = 30000, 8, 128
model = build_model(cfg.resolve(preset).run, vocab_size=VOCAB)
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(0)
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
def step():
    ids = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=gen)
    labels = ids.masked_fill(torch.rand(BATCH, LENGTH, generator=gen) > 0.15, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "token_type_ids": torch.zeros_like(ids),
             "sentence_order_label": torch.zeros(BATCH, dtype=torch.long)}
    forward_loss(model, batch).backward()
    opt.step()
    opt.zero_grad()
    if setting == "trim":
        libc.malloc_trim(0)
for _ in range(warmup):
    step()
started, peak = time.perf_counter(), 0.0
for _ in range(steps):
    step()
    peak = max(peak, rss_mib())
print(json.dumps({"s_per_step": (time.perf_counter() - started) / steps, "rss_mib": peak}))
"""


def run_setting(preset: str, setting, steps: int, warmup: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, preset, str(setting), str(steps), str(warmup)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    started = print_started()
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_ in range(args.repeats):
        names = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
        for name in names:
            got = run_setting(args.preset, SETTINGS[name], args.steps, args.warmup)
            results[name].append(got)
            print(f"round {round_ + 1}, {name}: {json.dumps(got)}", flush=True)
    summary = {
        name: {
            "s_per_step": round(statistics.mean(r["s_per_step"] for r in runs), 4),
            "rss_mib": round(statistics.mean(r["rss_mib"] for r in runs)),
        }
        for name, runs in results.items()
    }
    base = summary["glibc default"]
    print(f"\n{'setting':<24}{'s/step':>8}{'x default':>11}{'RSS MiB':>9}")
    for name, row in summary.items():
        ratio = row["s_per_step"] / base["s_per_step"]
        print(f"{name:<24}{row['s_per_step']:>8.3f}{ratio:>11.2f}{row['rss_mib']:>9}")
    print_finished(started)
    print(json.dumps({"event": "malloc_threshold_summary", "preset": args.preset, "settings": summary}))


if __name__ == "__main__":
    main()
