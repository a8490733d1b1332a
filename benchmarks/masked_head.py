"""What running a masked family's vocabulary head on the masked positions only saves a CPU trainer: step time
and resident memory, side by side.

transformers' masked-LM forward projects every position onto the vocabulary and the loss then ignores the
unmasked ones; ``cotrain.models.forward_loss`` projects only the masked ones (15% of a micro-batch). For each
preset this runs training steps (one CPU thread, a micro-batch of ``--batch`` x ``--length`` random tokens,
vocabulary 30,000; see ``lib/steps.py``) with the model's own forward ("full forward") and with cotrain's loss
("masked positions"), each in a fresh process, the order alternating over ``--repeats`` rounds.

    python benchmarks/masked_head.py [--presets albert-tiny bert-tiny roberta-tiny albert-base-v2]
                                     [--steps 20] [--repeats 2]

Last line: ``{"event": "masked_head_summary", "presets": {PRESET: {ARM: ROW}}}``, ROW with ``s_per_step``,
``rss_mib`` and ``peak_mib``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import steps  # noqa: E402

ARMS = {"full forward": {"loss": "full"}, "masked positions": {"loss": "forward_loss"}}
PRESETS = ["albert-tiny", "bert-tiny", "roberta-tiny", "albert-base-v2"]


def build_parser() -> argparse.ArgumentParser:
    return steps.build_parser(__doc__.split("\n\n")[0], PRESETS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    steps.compare_presets(
        __doc__.split("\n\n")[0], ARMS, "full forward", PRESETS, "masked_head_summary", argv
    )


if __name__ == "__main__":
    main()
