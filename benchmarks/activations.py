"""Activation memory of a preset at micro-batch 1: the bytes a training forward keeps for its backward pass,
with and without ``--gradient-checkpointing``, in bfloat16.

For each preset the model is built at full width and sequence length (the preset's) but with 1 and then 2 of
its layers, in bfloat16 on the CPU, and one forward of a micro-batch of 1 runs under a saved-tensors hook
that adds up the storages autograd keeps (each counted once; the parameters' own storages left out). The
layers are identical, so the preset's figure is exact from the two: ``kept(L) = rest + L x per_layer``.
With gradient checkpointing a layer keeps only its inputs, and the backward pass recomputes one layer at a
time, whose activations (``per_layer`` without checkpointing) come on top for that moment: the peak is
``kept(L) + per_layer``. torch's CPU kernel for bfloat16 attention is a flash kernel that keeps, as the GPU's
do, the output and the log-sum-exp, not the attention matrix; a GPU's figure differs by its kernels'
workspace and the allocator's rounding, not measured here.

    python benchmarks/activations.py [--presets llama-150m qwen-500m llama-1b]

A table (GiB), then a JSON line per preset (``{"event": "activations", ...}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch


def kept_bytes(preset: str, layers: int, checkpointing: bool) -> tuple[int, int]:
    """(Bytes kept for the backward pass by one forward of a micro-batch of 1, the preset's sequence
    length) for ``preset`` built with ``layers`` layers."""
    from cotrain import config as cfg
    from cotrain.models import build_model, enable_gradient_checkpointing, forward_loss

    run = cfg.resolve(preset).run
    key = "num_hidden_layers" if "num_hidden_layers" in run.model else "n_layer"
    run = dataclasses.replace(run, model={**run.model, key: layers})
    vocab = cfg.resolve(preset).prepare.vocab_size
    model = build_model(run, vocab_size=vocab).to(torch.bfloat16).train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, vocab, (1, run.max_seq_length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward_loss(model, {"input_ids": ids, "labels": ids})
    del loss
    return sum(kept.values()), run.max_seq_length


def measure(preset: str) -> dict:
    started = time.monotonic()
    from cotrain import config as cfg

    model = cfg.resolve(preset).run.model
    layers = model.get("num_hidden_layers", model.get("n_layer"))
    out: dict = {"event": "activations", "preset": preset, "layers": layers}
    for checkpointing in (False, True):
        one, seq = kept_bytes(preset, 1, checkpointing)
        two, _ = kept_bytes(preset, 2, checkpointing)
        per_layer, rest = two - one, one - (two - one)
        name = "checkpointing" if checkpointing else "full"
        out[f"{name}_per_layer"], out[f"{name}_rest"] = per_layer, rest
        out[f"{name}_kept"] = rest + layers * per_layer
        out["seq"] = seq
    out["checkpointing_peak"] = out["checkpointing_kept"] + out["full_per_layer"]
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["llama-150m", "qwen-500m", "llama-1b"])
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = [measure(preset) for preset in args.presets]
    gib = 2**30
    print("| preset | sequence | layers | kept per layer | without checkpointing | with: kept, peak | (GiB)")
    print("|---|---|---|---|---|---|")
    for r in results:
        kept, peak = r["checkpointing_kept"] / gib, r["checkpointing_peak"] / gib
        print(
            f"| `{r['preset']}` | {r['seq']} | {r['layers']} | {r['full_per_layer'] / gib:.3f} | "
            f"{r['full_kept'] / gib:.2f} | {kept:.2f}, {peak:.2f} |"
        )
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
