"""What glibc's malloc threshold costs a CPU trainer: step time against resident memory, side by side.

glibc gives a block of ``M_MMAP_THRESHOLD`` bytes or more a mapping of its own, returned to the system when
freed; by default it raises that threshold to the largest such block freed so far (up to 32 MB), so a training
step's activations come from the heap, which keeps its high-water mark. This runs training steps of a preset's
model (random tokens, 15% of them masked, one CPU thread) in a fresh process per setting, the settings
alternating over ``--repeats`` rounds: glibc's default; a fixed threshold of 128 KiB (what
``MALLOC_MMAP_THRESHOLD_=131072`` sets); the default with ``malloc_trim(0)`` after every step. Each process
reports its mean seconds per step (after ``--warmup`` steps), its largest RSS after a step and its peak RSS.

    python benchmarks/malloc_threshold.py [--preset albert-tiny] [--steps 25] [--repeats 2]

Last line: ``{"event": "malloc_threshold_summary", "settings": {NAME: ROW}}``, ROW with ``s_per_step``,
``rss_mib`` and ``peak_mib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib.netns import print_finished, print_started  # noqa: E402
from lib.steps import alternate, print_table  # noqa: E402

SETTINGS = {
    "glibc default": {},
    "threshold 128 KiB": {"mmap_threshold": 131072},
    "default + malloc_trim": {"trim": True},
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="albert-tiny")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = print_started()
    common = {"preset": args.preset, "steps": args.steps, "warmup": args.warmup}
    summary = alternate({name: {**common, **arm} for name, arm in SETTINGS.items()}, args.repeats)
    print_table(summary, "glibc default")
    print_finished(started)
    print(json.dumps({"event": "malloc_threshold_summary", "preset": args.preset, "settings": summary}))


if __name__ == "__main__":
    main()
