"""The model families cotrain trains: what each one learns from, and which transformers classes hold it.

Plain data (no torch import), so that config validation and `cotrain prepare` can read it cheaply;
``cotrain.models`` builds the models from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One model family: its objective, the tokenizer trained for it, and its transformers classes."""

    name: str  # the preset's model_family, equal to the transformers model_type
    objective: str  # the examples `cotrain prepare` makes for it (cotrain.data.objectives)
    tokenizer_type: str  # the tokenizer `cotrain prepare` trains for it (cotrain.data.tokenizer)
    config_class: str  # transformers configuration class
    model_class: str  # transformers model class trained (with its pre-training heads)
    auto_class: str  # the transformers Auto class that loads an exported folder
    inputs: tuple[str, ...]  # the batch columns its forward takes
    description: str
    attention: str = ""  # the attention implementation it is built with (transformers' default when "")


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "albert",
            "sop+mlm",
            "unigram",
            "AlbertConfig",
            "AlbertForPreTraining",
            "AutoModelForPreTraining",
            ("input_ids", "attention_mask", "token_type_ids", "labels", "sentence_order_label"),
            "ALBERT: sentence-order prediction + masked LM",
        ),
        Family(
            "bert",
            "mlm",
            "wordpiece",
            "BertConfig",
            "BertForMaskedLM",
            "AutoModelForMaskedLM",
            ("input_ids", "attention_mask", "token_type_ids", "labels"),
            "BERT: masked LM",
        ),
        Family(
            "distilbert",
            "mlm",
            "wordpiece",
            "DistilBertConfig",
            "DistilBertForMaskedLM",
            "AutoModelForMaskedLM",
            ("input_ids", "attention_mask", "labels"),
            "DistilBERT: masked LM",
        ),
        Family(
            "roberta",
            "mlm",
            "bpe",
            "RobertaConfig",
            "RobertaForMaskedLM",
            "AutoModelForMaskedLM",
            ("input_ids", "attention_mask", "labels"),
            "RoBERTa: masked LM",
        ),
        Family(
            "gpt2",
            "clm",
            "bpe",
            "GPT2Config",
            "GPT2LMHeadModel",
            "AutoModelForCausalLM",
            ("input_ids", "attention_mask", "labels"),
            "GPT-2: causal LM on contiguous packed blocks",
        ),
        Family(
            "llama",
            "clm",
            "bpe",
            "LlamaConfig",
            "LlamaForCausalLM",
            "AutoModelForCausalLM",
            ("input_ids", "attention_mask", "labels"),
            "Llama: RoPE, SwiGLU, RMSNorm decoder; causal LM on contiguous packed blocks",
            attention="sdpa",
        ),
        Family(
            "qwen2",
            "clm",
            "bpe",
            "Qwen2Config",
            "Qwen2ForCausalLM",
            "AutoModelForCausalLM",
            ("input_ids", "attention_mask", "labels"),
            "Qwen2: Llama-style decoder with grouped-query attention and q/k/v biases; causal LM",
            attention="sdpa",
        ),
    )
}


def family_problems(model_family: str, objective: str) -> list[str]:
    """Why a (model_family, objective) pair cannot train, one line each (empty when it can)."""
    family = FAMILIES.get(model_family)
    if family is None:
        return [f"model_family must be one of {', '.join(FAMILIES)}, got {model_family!r}"]
    if objective != family.objective:
        return [f"model_family {model_family} trains objective {family.objective!r}, not {objective!r}"]
    return []


def tokenizer_type_for(model_family: str, objective: str) -> str:
    """The tokenizer `cotrain prepare` trains by default: the family's when the examples are its own
    objective, otherwise "" (the objective's default)."""
    family = FAMILIES.get(model_family)
    return family.tokenizer_type if family is not None and family.objective == objective else ""
