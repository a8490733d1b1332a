"""Model families: a preset's architecture -> a model, its collator and loss. The families themselves
(objective, tokenizer, transformers classes) are in cotrain.families; parameter groups, the optimizer and the
schedule in cotrain.optim."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from cotrain.config import RunConfig
from cotrain.data import collator_for
from cotrain.data.collator import IGNORE_INDEX
from cotrain.errors import UserError
from cotrain.families import FAMILIES, Family

logger = logging.getLogger(__name__)


def family_of(run: RunConfig) -> Family:
    family = FAMILIES.get(run.model_family)
    if family is None:
        raise UserError(f"unknown model family {run.model_family!r}; choose one of {', '.join(FAMILIES)}")
    return family


def model_config(
    run: RunConfig,
    vocab_size: int,
    pad_token_id: int = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> transformers.PretrainedConfig:
    """The transformers configuration of the run's family from its [run.model] table; the vocabulary size
    and special token ids come from the tokenizer."""
    family = family_of(run)
    config_class = getattr(transformers, family.config_class)
    defaults = config_class()
    unknown = sorted(k for k in run.model if not hasattr(defaults, k))
    if unknown:
        raise UserError(f"[run.model] has keys {family.config_class} does not know: {', '.join(unknown)}")
    special: dict[str, int | None] = {"pad_token_id": pad_token_id}
    for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None:
            special[name] = value
        elif (getattr(defaults, name, None) or 0) >= vocab_size:  # GPT-2's 50256 past a smaller vocabulary
            special[name] = None
    attention = {"attn_implementation": family.attention} if family.attention else {}
    try:
        return config_class(vocab_size=vocab_size, **special, **attention, **run.model)
    except Exception as e:  # a value of the wrong type (transformers checks each field): one line
        raise UserError(f"[run.model] does not fit {family.config_class}: {_last_line(e)}") from None


def max_positions(config: transformers.PretrainedConfig) -> int:
    """The longest sequence a model configuration takes (RoBERTa's positions start after its padding id)."""
    n = int(config.max_position_embeddings)
    if config.model_type == "roberta":
        n -= int(config.pad_token_id) + 1
    return n


def model_for_tokenizer(run: RunConfig, tokenizer: Any) -> torch.nn.Module:
    """The run's model for ``tokenizer``: its vocabulary size and special token ids."""
    return build_model(
        run,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_model(
    run: RunConfig,
    vocab_size: int,
    pad_token_id: int = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> torch.nn.Module:
    """The run's model: freshly initialised from the preset's architecture, or, with ``run.init_from``,
    loaded from a pretrained Hugging Face model folder (or a Hub name where a network exists). Either way the
    vocabulary size comes from the tokenizer (a pretrained embedding is resized to it)."""
    family = family_of(run)
    torch.manual_seed(0)  # every peer starts from the same weights even before it loads the swarm's state
    if run.init_from:
        model = _pretrained(run, family, vocab_size)
        model.config.pad_token_id = pad_token_id
    else:
        config = model_config(run, vocab_size, pad_token_id, bos_token_id, eos_token_id)
        try:
            model = getattr(transformers, family.model_class)(config)
        except (TypeError, ValueError, KeyError, RuntimeError) as e:  # e.g. a negative size, an unknown act
            why = f"{type(e).__name__}: {_first_line(e)}"
            raise UserError(f"cannot build the {family.model_class} from [run.model] ({why})") from None
    if run.objective == "clm" and getattr(model, "loss_type", "") is None:
        # GPT-2's class name names no loss: transformers warns at the first step, then takes the causal one
        model.loss_type = "ForCausalLM"
    fuse_activations(model)
    return model


def fuse_activations(model: torch.nn.Module) -> int:
    """Give the model torch's fused kernel for the tanh-approximated GELU in place of transformers'
    ``gelu_new`` (ALBERT's and GPT-2's activation), the same function written as 8 tensor operations, each
    of which keeps its output for the backward pass: a feed-forward layer's activation then keeps one tensor
    for the backward pass instead of several (on ``albert-tiny`` at micro-batches of 8 x 128 tokens, 68 MiB
    less at a training step's peak: benchmarks/fused_gelu.py). The configuration, and so checkpoints and
    exports, still say ``gelu_new``; the two agree to float rounding. Returns how many activations were
    replaced."""
    from transformers.activations import NewGELUActivation, get_activation

    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is NewGELUActivation:
                setattr(module, name, get_activation("gelu_pytorch_tanh"))
                replaced += 1
    return replaced


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """--gradient-checkpointing: keep only each layer's inputs for the backward pass and recompute the rest
    (less memory for activations, about a third more compute)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"--gradient-checkpointing: {type(model).__name__} does not support it")
    enable = getattr(model, "activation_checkpointing_enable", None)  # its name from transformers 5.23 on
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    logger.info(f"Gradient checkpointing on for {type(model).__name__}")


def check_positions(model: torch.nn.Module, max_seq_length: int) -> None:
    """UserError unless the model takes sequences of ``max_seq_length`` tokens (said before training, rather
    than an index error in the middle of it)."""
    longest = max_positions(model.config)
    if longest < max_seq_length:
        raise UserError(
            f"the {model.config.model_type} model takes sequences of up to {longest} tokens, shorter than "
            f"max_seq_length {max_seq_length}; raise max_position_embeddings (RoBERTa: max_seq_length + 2) "
            "or lower max_seq_length"
        )


def _pretrained(run: RunConfig, family: Family, vocab_size: int) -> torch.nn.Module:
    """``from_pretrained`` of the family's class: offline from a local folder, by name otherwise."""
    model_class = getattr(transformers, family.model_class)
    local = Path(run.init_from).expanduser()
    if not local.is_dir() and (local.exists() or run.init_from.startswith((".", "/", "~"))):
        raise UserError(f"--init-from {run.init_from}: no model folder there (a save_pretrained folder)")
    source = str(local) if local.is_dir() else run.init_from
    kind = getattr(transformers, family.config_class).model_type
    try:
        found = transformers.AutoConfig.from_pretrained(source, local_files_only=local.is_dir()).model_type
    except Exception as e:  # no config.json, no network, unknown name: all one line for the user
        raise UserError(f"--init-from {run.init_from}: no model configuration ({_first_line(e)})") from None
    if found != kind:
        raise UserError(f"--init-from {run.init_from} holds a {found} model, but this run trains {kind}")
    try:
        attention = {"attn_implementation": family.attention} if family.attention else {}
        model = model_class.from_pretrained(
            source, local_files_only=local.is_dir(), dtype=torch.float32, **attention
        )
    except Exception as e:
        raise UserError(f"--init-from {run.init_from}: cannot load the model ({_first_line(e)})") from None
    if model.get_input_embeddings().num_embeddings != vocab_size:
        logger.info(
            f"Resizing the pretrained vocabulary ({model.get_input_embeddings().num_embeddings}) "
            f"to the tokenizer's ({vocab_size})"
        )
        model.resize_token_embeddings(vocab_size)
    logger.info(f"Initialised the {family.model_class} from {run.init_from}")
    return model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _last_line(e: BaseException, limit: int = 300) -> str:
    """The line of an error that says what is wrong (transformers' field checks put it last), shortened."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[-1] if lines else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of a model, tied weights counted once."""
    return sum(p.numel() for p in model.parameters())


def collator_for_run(run: RunConfig, tokenizer: Any, seed: int = 0) -> Callable:
    """The family's collator: SOP+MLM pairs (ALBERT), masked LM (BERT, DistilBERT, RoBERTa; whole-word
    masking with ``run.whole_word_mask``) or causal LM blocks (GPT-2, Llama, Qwen2)."""

    return collator_for(
        family_of(run).objective,
        tokenizer,
        mlm_probability=run.mlm_probability,
        seed=seed,
        whole_word_mask=run.whole_word_mask,
    )


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The family's training loss on one collated micro-batch: the model gets the columns its forward
    takes (ALBERT: masked LM + sentence order; BERT, DistilBERT, RoBERTa: masked LM; GPT-2, Llama, Qwen2:
    causal LM). A masked family's vocabulary head runs on the masked positions only (``masked_lm_loss``)."""
    inputs = model_inputs(model, batch)
    head = masked_lm_head(model)
    if head is not None and "labels" in inputs:
        if model.config.model_type != "albert" or "sentence_order_label" in inputs:
            return masked_lm_loss(model, head, inputs)
    out = model(**inputs)
    if out.loss is None:
        raise ValueError(f"the batch lacks the labels {type(model).__name__} needs: {sorted(batch)}")
    return out.loss


def masked_lm_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What turns a masked family's hidden states into vocabulary logits, position by position (None for the
    causal families, whose every position is a prediction)."""
    kind = model.config.model_type
    if kind == "albert":
        return model.predictions
    if kind == "bert":
        return model.cls
    if kind == "roberta":
        return model.lm_head
    if kind == "distilbert":
        return lambda h: model.vocab_projector(
            model.vocab_layer_norm(model.activation(model.vocab_transform(h)))
        )
    return None


def masked_lm_loss(
    model: torch.nn.Module, head: Callable[[torch.Tensor], torch.Tensor], inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The loss of the model's own forward (the mean cross-entropy over the masked tokens; ALBERT adds the
    sentence-order loss), with the vocabulary head applied to the masked positions only. transformers applies
    it to every position and ignores the unmasked ones in the loss: with 15% masked, 85% of the largest
    matrix product of a small model, and of its logits' memory (batch x length x vocabulary), went to
    positions without a label. The loss and the gradients are the same (tests/unit/test_families.py)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    order = inputs.pop("sentence_order_label", None)
    out = model.base_model(**inputs, return_dict=True)
    masked = labels != IGNORE_INDEX
    logits = head(out.last_hidden_state[masked])
    loss = torch.nn.functional.cross_entropy(logits, labels[masked].to(logits.device))
    if order is not None:  # ALBERT's sentence-order prediction, from the pooled first token
        loss = loss + torch.nn.functional.cross_entropy(
            model.sop_classifier(out.pooler_output), order.view(-1)
        )
    return loss


def model_inputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The columns of a collated batch that the model's forward takes (DistilBERT, RoBERTa and GPT-2 get no
    token types; only ALBERT gets sentence-order labels)."""
    family = FAMILIES[model.config.model_type]
    return {name: batch[name] for name in family.inputs if name in batch}
