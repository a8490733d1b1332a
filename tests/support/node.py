"""A tiny Llama and each rank's batches, for the tests of a peer of several ranks (cotrain.engine.node)."""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, num_key_value_heads=2, **shape))


def batch_of(rank: int, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(100 * step + rank))
    return {"input_ids": ids, "labels": ids}
