"""Llama- and Qwen2-style decoders: the full-size presets have the parameter counts of their shapes (built
on the meta device), --gradient-checkpointing is a per-peer option that keeps the gradients, and `cotrain
export` of a tiny twin's checkpoint is a folder that AutoModelForCausalLM loads with the checkpoint's logits
and that pipeline("text-generation") runs. The live two-peer run of a decoder is in
tests/live/test_families.py."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import WIKITEXT
from cotrain import checkpoints as ck
from cotrain import cli
from cotrain import config as cfg
from cotrain.errors import UserError

DECODER_TWINS = ("llama-tiny", "llama-1b-tiny", "qwen-tiny")


def decoder_parameters(
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    tied: bool,
    qkv_bias: bool,
) -> int:
    """Parameters of a Llama/Qwen2 decoder from its shape: per layer q, k, v, o projections (k and v for the
    key/value heads only; Qwen2 adds q/k/v biases), a SwiGLU MLP (gate, up, down) and two RMSNorm weights;
    then the final RMSNorm and the embeddings (the output projection shares the input's when tied)."""
    kv = kv_heads * (hidden // heads)
    attention = 2 * hidden * hidden + 2 * hidden * kv + ((hidden + 2 * kv) if qkv_bias else 0)
    layer = attention + 3 * hidden * intermediate + 2 * hidden
    return layers * layer + hidden + vocab * hidden * (1 if tied else 2)


# preset: (its shape's parameter count, the published count, vocabulary)
SHAPES = {
    # 12 x 768 (12 heads), SwiGLU 2560, 32k vocabulary, untied: 99.1M in the layers + 49.2M embeddings
    "llama-150m": (decoder_parameters(32000, 768, 12, 12, 12, 2560, False, False), 148_261_632, 32000),
    # Qwen2-0.5B: 24 x 896, 14 heads / 2 key-value heads, SwiGLU 4864, 151,936 tied: 494M as published
    "qwen-500m": (decoder_parameters(151936, 896, 24, 14, 2, 4864, True, True), 494_000_000, 151936),
    # TinyLlama-1.1B: 22 x 2048, 32 heads / 4 key-value heads, SwiGLU 5632, 32k untied: 1,100,048,384
    "llama-1b": (decoder_parameters(32000, 2048, 22, 32, 4, 5632, False, False), 1_100_048_384, 32000),
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models run fastest on one thread (see conftest.one_torch_thread)."""


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_full_size_decoders_have_the_parameter_count_of_their_shape(name):
    from cotrain.models import build_model, parameter_count

    from_shape, published, vocab = SHAPES[name]
    assert abs(from_shape - published) / published < 0.03, (name, from_shape, published)
    config = cfg.resolve(name)
    assert config.prepare.vocab_size == vocab  # `cotrain prepare --preset NAME` trains this vocabulary
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = build_model(config.run, vocab_size=vocab, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    assert next(model.parameters()).device.type == "meta"
    assert parameter_count(model) == from_shape, (name, parameter_count(model), from_shape)
    assert abs(parameter_count(model) - published) / published < 0.03
    # the modern decoder's parts: RoPE, SwiGLU (silu-gated MLP), RMSNorm, PyTorch SDPA attention
    assert model.config._attn_implementation == "sdpa"
    assert model.config.hidden_act == "silu" and hasattr(model.model.layers[0].mlp, "gate_proj")
    assert type(model.model.norm).__name__.endswith("RMSNorm")
    assert model.config.rope_parameters["rope_type"] == "default"
    assert (
        config.run.optimizer == "adamw"
        and config.run.lr_scheduler == "cosine"
        and config.run.warmup_steps > 0
    )
    assert config.run.objective == "clm"


def test_the_1b_preset_and_its_twin_share_their_attention_and_mlp_ratios(capsys):
    """`cotrain config show llama-1b` prints the shape; the CPU twin keeps its grouped-query attention (8
    query heads per key/value head) and its SwiGLU width ratio, so the code it runs is the 1B's."""
    import tomllib

    assert cli.main(["config", "show", "llama-1b"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["run"]["preset"] == "llama-1b" and shown["run"]["max_seq_length"] == 2048
    full, twin = shown["run"]["model"], cfg.resolve("llama-1b-tiny").run.model
    assert (full["hidden_size"], full["num_hidden_layers"], full["intermediate_size"]) == (2048, 22, 5632)
    for shape in (full, twin):
        assert shape["num_attention_heads"] // shape["num_key_value_heads"] == 8
        assert shape["intermediate_size"] / shape["hidden_size"] == 2.75
        assert shape["tie_word_embeddings"] is False
    assert shown["peer"]["per_device_train_batch_size"] == 1


def test_the_1b_preset_trains_with_sparse_diloco_and_config_show_takes_the_run_flags(capsys):
    """llama-1b's sync state does not fit a desktop (47 GB of RAM on a CPU, docs/models.md): the preset runs
    DiLoCo with sparse rounds. `config show` takes the flags `train` does; a user's other strategy gets dense
    rounds, not a refusal of the preset's compression, and two presets named are refused."""
    import tomllib

    def shown(*flags: str) -> dict:
        assert cli.main(["config", "show", "llama-1b", *flags]) == 0
        return tomllib.loads(capsys.readouterr().out)["run"]

    run = shown()
    assert (run["strategy"], run["outer_compression"], run["outer_momentum"]) == ("diloco", "topk", 0.0)
    run = shown("--strategy", "sync", "--learning-rate", "0.001")
    assert (run["strategy"], run["outer_compression"], run["learning_rate"]) == ("sync", "dense", 0.001)
    run = shown("--outer-compression", "dense", "--local-steps", "20")
    assert (run["strategy"], run["outer_compression"], run["local_steps"]) == ("diloco", "dense", 20)
    assert cli.main(["config", "show", "llama-1b", "--preset", "gpt2-tiny"]) == 2
    assert "two presets named" in capsys.readouterr().err
    assert cli.main(["config", "show", "llama-1b", "--strategy", "sync", "--outer-compression", "topk"]) != 0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer, as `cotrain prepare` trains for causal LM."""
    from cotrain.data import train_tokenizer
    from cotrain.data.corpus import read_wikitext

    texts = list(read_wikitext(WIKITEXT))[:60]
    return train_tokenizer(texts, "bpe", 600, tmp_path_factory.mktemp("tokenizer") / "bpe")


def _batch(tokenizer) -> dict[str, torch.Tensor]:
    from cotrain.data import collator_for

    text = (
        "the valkyria chronicles series is a tactical role playing game . it was released in japan in 2011 ."
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return collator_for("clm", tokenizer)([{"input_ids": ids}, {"input_ids": ids[3:]}])


def test_gradient_checkpointing_is_a_per_peer_option_that_keeps_the_gradients(tokenizer, capsys):
    from cotrain.models import enable_gradient_checkpointing, forward_loss, model_for_tokenizer

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--gradient-checkpointing" in capsys.readouterr().out
    _, on = cli.parse(["train", "--preset", "llama-tiny", "--gradient-checkpointing"])
    _, off = cli.parse(["train", "--preset", "llama-tiny"])
    assert on.peer.gradient_checkpointing and not off.peer.gradient_checkpointing
    assert cfg.config_hash(on.run) == cfg.config_hash(off.run)  # per peer: peers may differ in it

    batch = _batch(tokenizer)
    grads = []
    for checkpointing in (False, True):
        model = model_for_tokenizer(cfg.resolve("llama-tiny").run, tokenizer)  # the same seeded weights
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
            on = getattr(model, "is_activation_checkpointing", None)  # the name from transformers 5.23 on
            assert on if on is not None else model.is_gradient_checkpointing
        forward_loss(model, batch).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)
    albert = model_for_tokenizer(cfg.resolve("albert-tiny").run, tokenizer)
    with pytest.raises(UserError, match="AlbertForPreTraining does not support it"):
        enable_gradient_checkpointing(albert)


@pytest.mark.parametrize("twin", DECODER_TWINS)
def test_export_of_a_decoder_checkpoint_loads_with_the_auto_class_and_generates(twin, tokenizer, tmp_path):
    import transformers

    from cotrain.models import forward_loss, model_for_tokenizer
    from cotrain.optim import optimizer_factory, parameter_groups, scheduler_factory

    config = cfg.resolve(twin)
    model = model_for_tokenizer(config.run, tokenizer)
    optimizer = optimizer_factory(config.run)(parameter_groups(model, config.run.weight_decay))
    scheduler = scheduler_factory(config.run)(optimizer)
    batch = _batch(tokenizer)
    losses = []
    for _ in range(12):  # trained away from the initial weights
        loss = forward_loss(model, batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    saved = ck.save_checkpoint(
        tmp_path / "checkpoints", 12, model, optimizer, scheduler, config.to_dict(), tokenizer
    )
    out = tmp_path / "export"
    assert cli.main(["export", str(tmp_path / "checkpoints"), str(out)]) == 0
    assert json.loads((out / "cotrain.json").read_text())["auto_class"] == "AutoModelForCausalLM"

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(model)
    assert loaded.config.tie_word_embeddings == (twin == "qwen-tiny")
    assert loaded.config.num_key_value_heads == config.run.model["num_key_value_heads"]
    checkpoint_model, _ = ck.build_from_checkpoint(saved, ck.verify(saved))
    model.eval()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        expected = checkpoint_model(**inputs).logits
        torch.testing.assert_close(model(**inputs).logits, expected)  # the checkpoint holds the trained model
        torch.testing.assert_close(loaded(**inputs).logits, expected)  # and the export is that checkpoint
    assert expected.shape == (*batch["input_ids"].shape, len(tokenizer))
    # a new run can start from the export (--init-from): the same weights, with SDPA attention
    from cotrain.models import build_model

    start = build_model(cfg.resolve(twin, overrides={"run": {"init_from": str(out)}}).run, len(tokenizer))
    assert start.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(start.eval()(**inputs).logits, expected)

    generate = transformers.pipeline("text-generation", model=str(out), device="cpu")
    prompt = "the valkyria chronicles"
    result = generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert result.startswith(prompt) and result[len(prompt) :].strip(), result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the micro-batch probe measures a GPU's memory")
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_micro_batch_probe_sizes_a_full_decoder_on_a_gpu(name):
    from cotrain.host.hardware import Precision, auto_micro_batch, gpu_probe
    from cotrain.models import build_model, enable_gradient_checkpointing, forward_loss

    run = cfg.resolve(name).run
    device = torch.device("cuda", 0)
    precision = Precision(device, fp16=False, bf16=True)
    vocab = SHAPES[name][2]

    def make_batch(size: int) -> dict:
        ids = torch.randint(3, vocab, (size, run.max_seq_length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    found = []
    for checkpointing in (False, True):
        model = build_model(run, vocab_size=vocab, pad_token_id=1, bos_token_id=0, eos_token_id=2).to(device)
        model.train()
        if checkpointing:
            enable_gradient_checkpointing(model)
        fits = gpu_probe(model, make_batch, forward_loss, device, precision)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)  # the model's weights
        assert fits(2)
        peak = torch.cuda.max_memory_allocated(device) - held  # what a micro-batch of 2 takes on top
        micro, accumulation = auto_micro_batch(64, device, fits)
        found.append((micro, peak))
        assert micro >= 2 and micro * accumulation >= 64, (name, micro, accumulation)
        del model, fits
        torch.cuda.empty_cache()
    (micro_off, peak_off), (micro_on, peak_on) = found
    assert peak_on < peak_off and micro_on >= micro_off, found  # checkpointing: less memory, no smaller batch
