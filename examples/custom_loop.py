"""Train a model of your own with a training loop of your own, in a cotrain swarm.

A tiny GPT-2 built from a config (no download), a byte-level collator written here, and an optimizer and
schedule defined in Python; cotrain.SwarmPeer does the rest: it joins the swarm, averages gradients with the
other peers each time the swarm has accumulated --target-batch-size samples, and publishes this peer's loss
for a `cotrain monitor` of the same run id.

    # a first peer (it prints its address), and a second one joining it
    python examples/custom_loop.py --steps 20
    python examples/custom_loop.py --steps 20 --seed 1 --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/ID

    # or peers joining a monitor, which logs their loss (OUTPUT/metrics.jsonl, its dashboard)
    cotrain monitor --run-id custom-gpt2 --host-maddrs /ip4/127.0.0.1/tcp/0 --target-batch-size 64
    python examples/custom_loop.py --initial-peers $(cat outputs/initial_peers.txt)

It prints one JSON line when it is ready and one per global step: {"event": "step", "step": 3, "loss": ...,
"group_size": 2, ...}. Peers listen on 127.0.0.1 unless told otherwise (--host-maddrs /ip4/0.0.0.0/tcp/0
makes this one reachable from other machines).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import cotrain

EOS = 256  # byte values are tokens 0..255; this one ends a text and pads a block
IGNORE_INDEX = -100


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-id", default="custom-gpt2", help="run id shared by the peers (and the monitor)")
    p.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of peers already in the swarm")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"], help="where to listen")
    p.add_argument(
        "--steps",
        type=int,
        default=20,
        help="global steps of the swarm to train for, from the one it joins at",
    )
    p.add_argument("--target-batch-size", type=int, default=64, help="samples per global step, swarm-wide")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch on this peer")
    p.add_argument("--block-size", type=int, default=64, help="bytes per training sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--warmup-steps", type=int, default=2, help="global steps of linear warmup")
    p.add_argument("--matchmaking-time", type=float, default=2.0, help="seconds to wait for a group")
    p.add_argument("--averaging-timeout", type=float, default=10.0, help="seconds before a round is given up")
    p.add_argument("--seed", type=int, default=0, help="this peer's data order (give each peer its own)")
    p.add_argument("--text", help="a UTF-8 text file to train on (default: a text that ships with Python)")
    return p.parse_args(argv)


def load_text(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    return Path(argparse.__file__).read_text(
        encoding="utf-8"
    )  # the standard library's source is always there


def chunks(text: str, block_size: int, seed: int) -> Iterator[str]:
    """Endless pieces of ``text`` of about ``block_size`` bytes, in an order of this peer's own."""
    pieces = [text[i : i + block_size] for i in range(0, len(text) - block_size, block_size // 2)]
    rng = random.Random(seed)
    while True:
        rng.shuffle(pieces)
        yield from pieces


class ByteCollator:
    """Turns a list of strings into a causal-LM batch: UTF-8 bytes as tokens, EOS-padded blocks, and labels
    that ignore the padding (GPT-2 shifts the labels itself)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        input_ids = torch.full((len(texts), self.block_size), EOS, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, text in enumerate(texts):
            ids = list(text.encode("utf-8"))[: self.block_size - 1] + [EOS]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def build_model(block_size: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every peer starts from the same weights
    config = GPT2Config(
        vocab_size=EOS + 1,
        n_positions=block_size,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    return GPT2LMHeadModel(config)


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    model = build_model(args.block_size)
    collate = ByteCollator(args.block_size)
    texts = chunks(load_text(args.text), args.block_size, args.seed)
    warmup = max(1, args.warmup_steps)

    with cotrain.SwarmPeer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min(1.0, (step + 1) / warmup)
        ),
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        max_grad_norm=1.0,  # each step's gradients clipped to this norm before they go to the swarm
    ) as peer:
        say(event="ready", peer_id=peer.peer_id, maddrs=peer.maddrs, step=peer.global_step)
        # a peer that joins a swarm at step 40 trains until step 40 + steps
        last = peer.global_step + args.steps
        losses: list[float] = []
        started = time.monotonic()
        model.train()
        while peer.global_step < last:  # the loop of cotrain's own trainer (cotrain.roles.trainer)
            batch = collate([next(texts) for _ in range(args.batch_size)])
            loss = model(**batch).loss  # forward and backward over the micro-batch
            loss.backward()
            losses.append(loss.item())
            if peer.step(batch_size=args.batch_size, loss=losses[-1]):  # a global step of the swarm happened
                say(
                    event="step",
                    step=peer.global_step,
                    loss=round(sum(losses) / len(losses), 5),
                    group_size=peer.last_group_size,
                    peers=peer.num_peers,
                    seconds=round(time.monotonic() - started, 1),
                )
                losses.clear()
    say(event="done", step=last)
    return 0


if __name__ == "__main__":
    from cotrain.errors import UserError

    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # Ctrl+C: the `with` block has already left the swarm in order
        print("custom_loop: stopped (Ctrl+C)", file=sys.stderr)
        raise SystemExit(130) from None
    except UserError as e:  # an unreachable peer, a bad argument: one line, no traceback
        print(f"custom_loop: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
