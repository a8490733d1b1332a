"""What running a masked family's vocabulary head on the masked positions only saves a CPU trainer: step time
and resident memory, side by side.

transformers' masked-LM forward projects every position onto the vocabulary and the loss then ignores the
unmasked ones; ``cotrain.models.forward_loss`` projects only the masked ones (15% of a micro-batch). For each
preset this runs training steps (one CPU thread, a micro-batch of ``--batch`` x ``--length`` random tokens,
vocabulary 30,000; see ``_steps.py``) with the model's own forward ("full forward") and with cotrain's loss
("masked positions"), each in a fresh process, the order alternating over ``--repeats`` rounds.

    python benchmarks/masked_head.py [--presets albert-tiny bert-tiny roberta-tiny albert-base-v2]
                                     [--steps 20] [--repeats 2]

Last line: ``{"event": "masked_head_summary", "presets": {PRESET: {ARM: ROW}}}``, ROW with ``s_per_step``,
``rss_mib`` and ``peak_mib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _netns import print_finished, print_started  # noqa: E402
from _steps import alternate, print_table  # noqa: E402

ARMS = {"full forward": {"loss": "full"}, "masked positions": {"loss": "forward_loss"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--presets", nargs="+", default=["albert-tiny", "bert-tiny", "roberta-tiny", "albert-base-v2"]
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    started = print_started()
    results = {}
    for preset in args.presets:
        common = {"preset": preset, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
                  "length": args.length}  # fmt: skip
        print(f"\n{preset}, micro-batch {args.batch} x {args.length}", flush=True)
        results[preset] = alternate({name: {**common, **arm} for name, arm in ARMS.items()}, args.repeats)
        print_table(results[preset], "full forward", heading=preset)
    print_finished(started)
    print(json.dumps({"event": "masked_head_summary", "batch": args.batch, "length": args.length,
                      "presets": results}))  # fmt: skip


if __name__ == "__main__":
    main()
