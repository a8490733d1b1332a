"""What running ALBERT's and GPT-2's ``gelu_new`` as torch's fused kernel saves a CPU trainer: step time and
resident memory, side by side.

transformers writes ``gelu_new`` as 8 tensor operations, each keeping its output for the backward pass;
``cotrain.models.build_model`` gives the model torch's fused kernel of the same function, which keeps only its
input. For each preset this runs training steps (one CPU thread, a micro-batch of ``--batch`` x ``--length``
random tokens, vocabulary 30,000, cotrain's loss; see ``lib/steps.py``) with transformers' activation
("transformers' gelu_new") and with cotrain's ("fused kernel"), each in a fresh process, the order alternating
over ``--repeats`` rounds.

    python benchmarks/fused_gelu.py [--presets albert-tiny gpt2-tiny] [--steps 20] [--repeats 2]

Last line: ``{"event": "fused_gelu_summary", "presets": {PRESET: {ARM: ROW}}}``, ROW with ``s_per_step``,
``rss_mib`` and ``peak_mib``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lib import steps  # noqa: E402

ARMS = {"transformers' gelu_new": {"unfused_gelu": True}, "fused kernel": {}}
PRESETS = ["albert-tiny", "gpt2-tiny"]


def build_parser() -> argparse.ArgumentParser:
    return steps.build_parser(__doc__.split("\n\n")[0], PRESETS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    steps.compare_presets(
        __doc__.split("\n\n")[0], ARMS, "transformers' gelu_new", PRESETS, "fused_gelu_summary", argv
    )


if __name__ == "__main__":
    main()
