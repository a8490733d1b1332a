"""Batching for ALBERT pre-training: pad SOP examples and apply BERT's MLM masking."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
# column -> padding value
PADDED_COLUMNS = {"token_type_ids": 0, "attention_mask": 0, "special_tokens_mask": 1}


@dataclass
class AlbertCollator:
    """Collate SOP examples (lists or tensors, as produced by ``build_sop_examples`` or
    ``load_prepared``) into a batch for ``AlbertForPreTraining``.

    Pads to the longest example (rounded up to ``pad_to_multiple_of``) and masks tokens as BERT
    does: ``mlm_probability`` of the non-special, non-pad tokens are selected (at least one per
    batch); of those 80% become [MASK], 10% a random non-special token, 10% stay unchanged. ``labels``
    hold the original ids at selected positions and -100 elsewhere. Masking draws from a
    ``torch.Generator`` seeded with ``seed`` (and the DataLoader worker id, inside a worker), so a
    run is reproducible.
    """

    tokenizer: PreTrainedTokenizerBase
    mlm_probability: float = 0.15
    pad_to_multiple_of: int | None = None
    seed: int = 0
    generator: torch.Generator = field(init=False, repr=False)
    _generator_worker: int | None = field(init=False, repr=False, default=None)
    _random_ids: torch.Tensor = field(init=False, repr=False)
    _special_ids: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {self.mlm_probability}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be positive, got {self.pad_to_multiple_of}")
        for name in ("mask_token_id", "pad_token_id"):
            if getattr(self.tokenizer, name, None) is None:
                raise ValueError(f"the tokenizer has no {name.removesuffix('_id')}; MLM needs one")
        special = set(self.tokenizer.all_special_ids)
        self._random_ids = torch.tensor([i for i in range(len(self.tokenizer)) if i not in special])
        # ids that are never masked when an example carries no special_tokens_mask
        unk = self.tokenizer.unk_token_id
        self._special_ids = torch.tensor(sorted(i for i in special if i != unk))
        self.generator = torch.Generator().manual_seed(self.seed)

    def _reseed_for_worker(self) -> None:
        """Inside a DataLoader worker every copy of the collator starts from the same generator
        state; give each worker its own stream."""
        info = torch.utils.data.get_worker_info()
        worker = None if info is None else info.id
        if worker != self._generator_worker:
            digest = hashlib.sha256(f"{self.seed}:{worker}".encode()).digest()
            self.generator.manual_seed(int.from_bytes(digest[:8], "big") & (2**63 - 1))
            self._generator_worker = worker

    def _pad(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples]
        length = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {"input_ids": torch.full((len(ids), length), self.tokenizer.pad_token_id, dtype=torch.long)}
        for column, value in PADDED_COLUMNS.items():
            batch[column] = torch.full((len(ids), length), value, dtype=torch.long)
        for row, (example, row_ids) in enumerate(zip(examples, ids, strict=True)):
            n = len(row_ids)
            batch["input_ids"][row, :n] = row_ids
            batch["attention_mask"][row, :n] = torch.as_tensor(example.get("attention_mask", 1))
            if "token_type_ids" in example:
                batch["token_type_ids"][row, :n] = torch.as_tensor(example["token_type_ids"])
            if "special_tokens_mask" in example:
                batch["special_tokens_mask"][row, :n] = torch.as_tensor(example["special_tokens_mask"])
            else:
                batch["special_tokens_mask"][row, :n] = torch.isin(row_ids, self._special_ids).long()
        return batch

    def _coin(self, shape: torch.Size, p: float) -> torch.Tensor:
        return torch.bernoulli(torch.full(shape, p), generator=self.generator).bool()

    def mask_tokens(
        self, input_ids: torch.Tensor, special_tokens_mask: torch.Tensor, selected: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT masking; returns (masked input_ids, labels). ``special_tokens_mask`` is 1 on tokens
        that must not be selected (specials and padding); ``selected``, when given, is the selection
        (whole-word masking makes its own)."""
        eligible = special_tokens_mask == 0
        if selected is None:
            probability = torch.full(input_ids.shape, self.mlm_probability).masked_fill_(~eligible, 0.0)
            selected = torch.bernoulli(probability, generator=self.generator).bool()
        if not selected.any() and eligible.any():
            candidates = eligible.flatten().nonzero().squeeze(1)
            pick = candidates[torch.randint(len(candidates), (1,), generator=self.generator)]
            selected.view(-1)[pick] = True
        labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
        masked = input_ids.clone()
        to_mask = self._coin(input_ids.shape, 0.8) & selected
        masked[to_mask] = self.tokenizer.mask_token_id
        to_random = self._coin(input_ids.shape, 0.5) & selected & ~to_mask
        picks = torch.randint(len(self._random_ids), (int(to_random.sum()),), generator=self.generator)
        masked[to_random] = self._random_ids[picks]
        return masked, labels

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        self._reseed_for_worker()
        batch = self._pad(examples)
        input_ids, labels = self.mask_tokens(batch["input_ids"], batch["special_tokens_mask"])
        return {
            "input_ids": input_ids,
            "token_type_ids": batch["token_type_ids"],
            "attention_mask": batch["attention_mask"],
            "labels": labels,
            "sentence_order_label": torch.tensor(
                [int(example["sentence_order_label"]) for example in examples], dtype=torch.long
            ),
        }


@dataclass
class MlmCollator(AlbertCollator):
    """Masked-LM batches (BERT, RoBERTa, DistilBERT): ``input_ids, token_type_ids, attention_mask,
    labels``. With ``whole_word_mask`` a word's pieces are selected together: pieces that continue a
    word (WordPiece ``##x``; for Unigram/byte-level BPE, pieces without the word-start marker ``▁``/``Ġ``)
    follow the selection of the piece that starts it."""

    whole_word_mask: bool = False
    _continues: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        vocab = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        has_markers = any(str(t).startswith(("▁", "Ġ")) for t in vocab)
        special = set(self.tokenizer.all_special_ids)

        def continues(i: int, token: str) -> bool:
            if i in special or token is None:
                return False
            if token.startswith("##"):
                return True
            return has_markers and not token.startswith(("▁", "Ġ")) and token[:1].isalnum()

        self._continues = torch.tensor([continues(i, t) for i, t in enumerate(vocab)], dtype=torch.bool)

    def _whole_words(self, input_ids: torch.Tensor, special_tokens_mask: torch.Tensor) -> torch.Tensor:
        """A selection where each word is taken or left as a whole (about ``mlm_probability`` of words)."""
        continues = self._continues[input_ids] & (special_tokens_mask == 0)
        starts = (special_tokens_mask == 0) & ~continues
        chosen = torch.bernoulli(starts.float() * self.mlm_probability, generator=self.generator).bool()
        if not chosen.any() and starts.any():
            candidates = starts.flatten().nonzero().squeeze(1)
            chosen.view(-1)[candidates[torch.randint(len(candidates), (1,), generator=self.generator)]] = True
        word = torch.cumsum(starts.long(), dim=1)  # the index of each piece's word within its row
        # a piece is selected if the start of its word is
        chosen_word = torch.zeros_like(word, dtype=torch.bool)
        for row in range(input_ids.shape[0]):
            taken = word[row][chosen[row]]
            chosen_word[row] = torch.isin(word[row], taken) & (special_tokens_mask[row] == 0)
        return chosen_word

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        self._reseed_for_worker()
        batch = self._pad(examples)
        if self.whole_word_mask:
            selected = self._whole_words(batch["input_ids"], batch["special_tokens_mask"])
            input_ids, labels = self.mask_tokens(batch["input_ids"], batch["special_tokens_mask"], selected)
        else:
            input_ids, labels = self.mask_tokens(batch["input_ids"], batch["special_tokens_mask"])
        return {
            "input_ids": input_ids,
            "token_type_ids": batch["token_type_ids"],
            "attention_mask": batch["attention_mask"],
            "labels": labels,
        }


@dataclass
class ClmCollator:
    """Causal-LM batches (GPT-2): ``input_ids, attention_mask, labels`` with ``labels = input_ids`` and
    -100 on padding (the model shifts labels itself). Packed blocks are all the same length, so
    padding only happens for examples of other lengths."""

    tokenizer: PreTrainedTokenizerBase
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        ids = [torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples]
        length = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(ids), length), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), length), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = x
            attention_mask[row, : len(x)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collator_for(
    objective: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    mlm_probability: float = 0.15,
    seed: int = 0,
    whole_word_mask: bool = False,
) -> AlbertCollator | MlmCollator | ClmCollator:
    """The collator of an objective: sop+mlm -> AlbertCollator, mlm -> MlmCollator, clm -> ClmCollator."""
    if objective == "sop+mlm":
        return AlbertCollator(tokenizer, mlm_probability=mlm_probability, seed=seed)
    if objective == "mlm":
        return MlmCollator(
            tokenizer, mlm_probability=mlm_probability, seed=seed, whole_word_mask=whole_word_mask
        )
    if objective == "clm":
        return ClmCollator(tokenizer)
    raise ValueError(f"unknown objective {objective!r}")
