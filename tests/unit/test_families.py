"""Model families from presets: every preset builds its family's model (full sizes checked on the meta
device), `cotrain prepare --preset` makes the family's examples and tokenizer, optimizers and schedules
by name, --init-from a pretrained folder, and each family's CPU twin trains a step and its checkpoint exports
to a folder that the family's Auto class loads with the same logits. Two trainers of a twin training together
in a live swarm: tests/live/test_families.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from cotrain import cli
from cotrain import config as cfg
from cotrain.errors import UserError
from cotrain.families import FAMILIES, tokenizer_type_for
from support.families import TWINS

# published sizes (millions of parameters) with each family's standard vocabulary
KNOWN_SIZES = {
    "albert-large-v2": (17.7, 30000),
    "albert-base-v2": (11.7, 30000),
    "bert-base": (110.0, 30522),
    "distilbert-base": (66.0, 30522),
    "roberta-base": (125.0, 50265),
    "gpt2-small": (124.0, 50257),
    # computed from the shapes in tests/unit/test_decoders.py (llama-150m has no published checkpoint)
    "llama-150m": (148.26, 32000),
    "qwen-500m": (494.0, 151936),  # Qwen2-0.5B, tied embeddings counted once
    "llama-1b": (1100.05, 32000),  # TinyLlama-1.1B
}


TOKENIZER_MODEL = {"unigram": "Unigram", "wordpiece": "WordPiece", "bpe": "BPE"}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models run fastest on one thread (see conftest.one_torch_thread)."""


def test_every_preset_names_a_family_and_its_objective():
    names = cfg.preset_names()
    assert set(TWINS) | set(TWINS.values()) == set(names), names
    for name in names:
        run = cfg.resolve(name).run
        assert FAMILIES[run.model_family].objective == run.objective, name
        twin = cfg.resolve(TWINS.get(name, name)).run
        assert twin.model_family == run.model_family, (name, twin.preset)
    assert {cfg.resolve(n).run.model_family for n in names} == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(KNOWN_SIZES))
def test_full_size_presets_have_the_published_parameter_counts(name):
    from cotrain.models import build_model, parameter_count

    known, vocab = KNOWN_SIZES[name]
    pad = 1 if name.startswith("roberta") else 0
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = build_model(cfg.resolve(name).run, vocab_size=vocab, pad_token_id=pad)
    assert type(model).__name__ == FAMILIES[model.config.model_type].model_class
    millions = parameter_count(model) / 1e6
    assert abs(millions - known) / known < 0.03, (name, millions, known)


@pytest.fixture(scope="module")
def tokenizers(small_corpus, tmp_path_factory) -> dict:
    from cotrain.data import train_tokenizer
    from cotrain.data.corpus import read_wikitext

    texts = list(read_wikitext(small_corpus))[:60]
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: train_tokenizer(texts, kind, 600, root / kind) for kind in TOKENIZER_MODEL}


def _batch(family: str, tokenizer) -> list[dict]:
    """Two examples of the family's objective, made from real sentences."""
    a, b = "the valkyria chronicles series is a tactical game .", "it was released in japan in 2011 ."
    if family == "albert":
        enc = tokenizer(a, b)
        return [{**enc, "sentence_order_label": label} for label in (0, 1)]
    if FAMILIES[family].objective == "clm":
        ids = tokenizer(a + " " + b, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [{"input_ids": ids}, {"input_ids": ids[::-1]}]
    return [tokenizer(a), tokenizer(b)]


@pytest.mark.parametrize("twin", sorted(set(TWINS.values())))
def test_each_twin_builds_trains_a_step_and_its_checkpoint_exports_for_its_auto_class(
    twin, tokenizers, tmp_path
):
    from cotrain.models import build_model, collator_for_run, forward_loss, parameter_count
    from cotrain.optim import optimizer_factory, parameter_groups

    run = cfg.resolve(twin).run
    family = FAMILIES[run.model_family]
    tokenizer = tokenizers[tokenizer_type_for(run.model_family, run.objective)]
    model = build_model(
        run, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    assert type(model).__name__ == family.model_class
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)  # the vocabulary is the tokenizer's
    if run.objective == "clm":  # a causal LM names its loss (GPT2LMHeadModel's name does not: a warning)
        assert model.loss_type == "ForCausalLM"
    assert 0.5e6 < parameter_count(model) < 8e6, parameter_count(model)
    batch = collator_for_run(run, tokenizer, seed=0)(_batch(run.model_family, tokenizer))
    optimizer = optimizer_factory(run)(parameter_groups(model, run.weight_decay))
    losses = []
    for _ in range(3):  # the same batch three times: the loss must go down
        loss = forward_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    # its trainer's checkpoint exports to a folder that the family's Auto class loads, with the same logits
    import transformers
    from transformers import AutoTokenizer

    from cotrain import checkpoints as ck
    from cotrain.optim import scheduler_factory

    scheduler = scheduler_factory(run)(optimizer)
    saved = ck.save_checkpoint(
        tmp_path / "checkpoints", 3, model, optimizer, scheduler, cfg.resolve(twin).to_dict(), tokenizer
    )
    assert cli.main(["export", str(tmp_path / "checkpoints"), str(tmp_path / "export")]) == 0
    exported = json.loads((tmp_path / "export" / "cotrain.json").read_text())
    assert exported["auto_class"] == family.auto_class and Path(exported["checkpoint"]) == saved
    loaded = getattr(transformers, family.auto_class).from_pretrained(tmp_path / "export")
    assert type(loaded).__name__ == family.model_class
    loaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert loaded.get_input_embeddings().num_embeddings == len(loaded_tokenizer)
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs)[0], model(**inputs)[0])


@pytest.mark.parametrize("twin", ["albert-tiny", "bert-tiny", "distilbert-tiny", "roberta-tiny"])
def test_the_masked_positions_loss_and_gradients_are_the_full_forwards(twin, tokenizers):
    """forward_loss runs a masked family's vocabulary head on the masked positions only; transformers' own
    forward runs it on all of them and ignores the rest in the loss. Both give the same loss and gradients."""
    from cotrain.models import build_model, collator_for_run, forward_loss, masked_lm_head, model_inputs

    run = cfg.resolve(twin).run
    tokenizer = tokenizers[tokenizer_type_for(run.model_family, run.objective)]
    model = build_model(
        run, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    model.eval()  # no dropout: both forwards see the same network
    assert masked_lm_head(model) is not None
    examples = _batch(run.model_family, tokenizer) * 4
    batch = collator_for_run(run, tokenizer, seed=1)(examples)
    masked = int((batch["labels"] != -100).sum())
    assert 0 < masked < batch["labels"].numel() // 2, masked  # some positions masked, most not

    def loss_and_grads(loss_of) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = loss_of()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    rows: list[int] = []  # how many positions the vocabulary projection gets
    model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: rows.append(args[0].numel() // args[0].shape[-1])
    )
    ours, our_grads = loss_and_grads(lambda: forward_loss(model, batch))
    full, full_grads = loss_and_grads(lambda: model(**model_inputs(model, batch)).loss)
    assert rows == [masked, batch["labels"].numel()]
    assert ours == pytest.approx(full, rel=1e-5)
    assert len(our_grads) == len(full_grads) > 0
    for mine, theirs in zip(our_grads, full_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("twin", ["albert-tiny", "gpt2-tiny"])
def test_gelu_new_runs_as_the_fused_kernel_with_the_same_loss_gradients_and_config(twin, tokenizers):
    """ALBERT's and GPT-2's ``gelu_new`` runs as torch's fused tanh-GELU: the same loss and gradients as
    transformers' own activation, fewer bytes kept for the backward pass, and the configuration unchanged."""
    from transformers.activations import NewGELUActivation

    from cotrain.models import build_model, collator_for_run, forward_loss

    run = cfg.resolve(twin).run
    tokenizer = tokenizers[tokenizer_type_for(run.model_family, run.objective)]
    model = build_model(
        run, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    model.eval()
    assert "gelu_new" in (
        getattr(model.config, "hidden_act", None),
        getattr(model.config, "activation_function", None),
    )
    fused = [m for m in model.modules() if type(m).__name__ == "GELUTanh"]
    assert fused and not any(isinstance(m, NewGELUActivation) for m in model.modules())
    batch = collator_for_run(run, tokenizer, seed=1)(_batch(run.model_family, tokenizer) * 4)

    def run_step() -> tuple[float, list[torch.Tensor], int]:
        saved = []
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            loss = forward_loss(model, batch)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None], sum(saved)

    loss, grads, saved_bytes = run_step()
    for module in list(model.modules()):  # transformers' own activation back in place
        for name, child in list(module.named_children()):
            if type(child).__name__ == "GELUTanh":
                setattr(module, name, NewGELUActivation())
    their_loss, their_grads, their_saved_bytes = run_step()
    assert loss == pytest.approx(their_loss, rel=1e-5)
    for mine, theirs in zip(grads, their_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    assert saved_bytes < 0.8 * their_saved_bytes, (saved_bytes, their_saved_bytes)


@pytest.mark.parametrize("drop", ["labels", "sentence_order_label"])
def test_a_batch_without_its_labels_is_one_clear_error(drop, tokenizers):
    from cotrain.models import build_model, collator_for_run, forward_loss

    run = cfg.resolve("albert-tiny").run
    tokenizer = tokenizers[tokenizer_type_for(run.model_family, run.objective)]
    model = build_model(
        run, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    batch = collator_for_run(run, tokenizer, seed=1)(_batch(run.model_family, tokenizer))
    del batch[drop]
    with pytest.raises(ValueError, match="lacks the labels AlbertForPreTraining needs"):
        forward_loss(model, batch)


def test_whole_word_masking_is_a_run_option(tokenizers):
    from cotrain.data import MlmCollator
    from cotrain.models import collator_for_run

    run = cfg.resolve("bert-tiny", overrides={"run": {"whole_word_mask": True}}).run
    collator = collator_for_run(run, tokenizers["wordpiece"])
    assert isinstance(collator, MlmCollator) and collator.whole_word_mask
    assert not collator_for_run(cfg.resolve("bert-tiny").run, tokenizers["wordpiece"]).whole_word_mask


def test_optimizers_and_schedules_by_name():
    from cotrain.optim import Lamb, optimizer_factory, scheduler_factory

    params = [torch.nn.Parameter(torch.zeros(2))]
    for preset, optimizer, schedule in (
        ("albert-tiny", Lamb, "linear"),
        ("gpt2-tiny", torch.optim.AdamW, "cosine"),
    ):
        run = cfg.resolve(preset, overrides={"run": {"warmup_steps": 10, "total_steps": 110}}).run
        assert run.lr_scheduler == schedule
        opt = optimizer_factory(run)(params)
        assert isinstance(opt, optimizer)
        sched = scheduler_factory(run)(opt)
        lrs = []
        for _ in range(111):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        peak = run.learning_rate
        assert lrs[0] == 0 and lrs[5] == pytest.approx(peak / 2) and lrs[10] == pytest.approx(peak)
        # half way through the decay both are at half the peak; a quarter in: 3/4 vs (1 + cos(pi/4)) / 2
        assert lrs[60] == pytest.approx(peak / 2)
        quarter = 0.75 if schedule == "linear" else (1 + math.cos(math.pi / 4)) / 2
        assert lrs[35] == pytest.approx(peak * quarter) and lrs[110] == pytest.approx(0.0, abs=1e-12)
    adamw = cfg.resolve(
        "albert-tiny", overrides={"run": {"optimizer": "adamw", "lr_scheduler": "cosine"}}
    ).run
    assert isinstance(optimizer_factory(adamw)(params), torch.optim.AdamW)


def test_bad_family_objective_or_schedule_is_one_clear_error(tmp_path):
    cases = [
        (
            {"model_family": "xlnet"},
            "model_family must be one of albert, bert, distilbert, roberta, gpt2, llama, qwen2, got 'xlnet'",
        ),
        ({"objective": "clm"}, "model_family bert trains objective 'mlm', not 'clm'"),
        ({"lr_scheduler": "step"}, "lr_scheduler must be linear or cosine"),
    ]
    for override, message in cases:
        with pytest.raises(cfg.ConfigError, match=re.escape(message)):
            cfg.resolve("bert-tiny", overrides={"run": override})
    from cotrain.models import build_model, check_positions

    with pytest.raises(UserError, match="hidden_sise"):
        build_model(cfg.resolve("bert-tiny", overrides={"run": {"model": {"hidden_sise": 3}}}).run, 500)
    roberta = build_model(cfg.resolve("roberta-tiny").run, 500, 1)
    check_positions(roberta, 128)
    with pytest.raises(UserError, match="takes sequences of up to 128 tokens"):
        check_positions(roberta, 129)


@pytest.mark.parametrize(
    "preset, objective, tokenizer",
    [("roberta-tiny", "mlm", "BPE"), ("bert-tiny", "mlm", "WordPiece"), ("gpt2-tiny", "clm", "BPE")],
)
def test_prepare_follows_the_preset(preset, objective, tokenizer, small_corpus, tmp_path, capsys):
    out = tmp_path / "data"
    argv = ["prepare", "--preset", preset, "--text-files", str(small_corpus), "--output", str(out)]
    assert cli.main([*argv, "--max-seq-length", "64", "--vocab-size", "500"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["objective"] == objective and manifest["num_examples"]["train"] > 100
    assert json.loads((out / "tokenizer" / "tokenizer.json").read_text())["model"]["type"] == tokenizer
    if preset == "gpt2-tiny":
        assert manifest["mean_tokens_per_example"] == 64  # contiguous packed blocks


def test_init_from_a_local_pretrained_folder(tmp_path, tokenizers):
    from cotrain.models import build_model

    run = cfg.resolve("bert-tiny", overrides={"run": {"model": {"num_hidden_layers": 1}}}).run
    pretrained = build_model(run, vocab_size=500)
    with torch.no_grad():
        pretrained.bert.embeddings.word_embeddings.weight.mul_(3.0)  # not what a fresh init gives
    pretrained.save_pretrained(tmp_path / "bert")
    start = cfg.resolve("bert-tiny", overrides={"run": {"init_from": str(tmp_path / "bert")}}).run
    model = build_model(start, vocab_size=500)
    assert model.config.num_hidden_layers == 1  # the folder's architecture, not the preset's 4 layers
    for (name, a), b in zip(pretrained.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    bigger = build_model(start, vocab_size=520)  # the tokenizer decides the vocabulary: resized
    embeddings = bigger.get_input_embeddings().weight
    assert embeddings.shape[0] == 520
    assert torch.equal(embeddings[:500], pretrained.get_input_embeddings().weight)
    gpt = cfg.resolve("gpt2-tiny", overrides={"run": {"init_from": str(tmp_path / "bert")}}).run
    with pytest.raises(UserError, match="holds a bert model, but this run trains gpt2"):
        build_model(gpt, vocab_size=500)
    missing = cfg.resolve("bert-tiny", overrides={"run": {"init_from": str(tmp_path / "nothing")}}).run
    with pytest.raises(UserError, match="no model folder there"):
        build_model(missing, vocab_size=500)
