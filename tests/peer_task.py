"""The task the live tests' peer scripts train (tests/diloco_peer.py, tests/defence_peer.py, the peer of
tests/statecheck_peer.py): a noisy linear map of DIM inputs, the same on every peer, each peer drawing its own
batches from its seed; and the JSON lines a peer script writes for its test to read."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable

import torch

DIM = 16
TARGET = torch.arange(DIM, dtype=torch.float32) / DIM
INIT_SEED = 1234  # the same initial parameters on every peer


class Task:
    """Batches of the regression from ``seed``'s own stream."""

    def __init__(self, seed: int):
        self.data = torch.Generator().manual_seed(seed)

    def loss(self, model: torch.nn.Module, batch: int) -> torch.Tensor:
        """The mean squared error of ``model`` on a fresh batch of ``batch`` examples."""
        x = torch.randn(batch, DIM, generator=self.data)
        y = x @ TARGET + 0.01 * torch.randn(batch, generator=self.data)
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)


def jsonl(path: str) -> tuple[Callable[..., None], Callable[[], None]]:
    """(emit(**row): append one JSON line to ``path`` at once, close)."""
    out = open(path, "a", buffering=1)

    def emit(**row) -> None:
        out.write(json.dumps(row) + "\n")

    return emit, out.close


def flat(tensors: Iterable[torch.Tensor]) -> list[float]:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).tolist()


def peer_arguments(*, target_batch_size: int, step_sleep: float, run_id: str) -> argparse.ArgumentParser:
    """The options every peer script takes (its own added after): where it writes, whom it joins, its data
    seed and batch, the swarm's target batch, its simulated compute, its run, and --until FILE (train on past
    its steps until FILE exists)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--target-batch-size", type=int, default=target_batch_size)
    p.add_argument("--step-sleep", type=float, default=step_sleep, help="seconds per step (simulated)")
    p.add_argument("--run-id", default=run_id)
    p.add_argument("--until", help="train on (past the steps asked) until this file exists")
    return p
