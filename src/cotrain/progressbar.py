"""The trainer's progress bar toward the next global step (tqdm on stderr, only when stderr is a terminal,
so that logs written to files stay clean)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class StepProgress:
    """Samples the swarm has accumulated toward the next global step, and this peer's micro-steps in it."""

    def __init__(self, target_batch_size: int, enabled: bool | None = None):
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total = target_batch_size
        self.bar = tqdm(
            total=target_batch_size,
            unit="samples",
            file=sys.stderr,
            disable=not enabled,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc} {bar} {n_fmt}/{total_fmt} samples {postfix}",
        )
        self.epoch, self.micro_steps = -1, 0

    def update(self, step: int, samples_accumulated: int, num_peers: int) -> None:
        """Call after each optimizer step: the global step this peer is at, the samples the swarm has
        accumulated toward the next one, and the peers it counts."""
        if self.bar.disable:
            return
        if step != self.epoch:
            self.epoch, self.micro_steps = step, 0
        self.micro_steps += 1
        self.bar.set_description_str(f"step {step + 1}")
        self.bar.n = min(int(samples_accumulated), self.total)
        self.bar.set_postfix_str(f"({self.micro_steps} local micro-steps, {num_peers} peers)")

    def close(self) -> None:
        self.bar.close()
