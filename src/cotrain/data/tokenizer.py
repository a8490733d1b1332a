"""Tokenizers trained here (one per model family), and loading, saving and fingerprinting them.

- ``unigram`` (ALBERT): the layout of ``albert-base-v2``: ids 0-4 are ``<pad> <unk> [CLS] [SEP] [MASK]``,
  text is NFKC normalized and lowercased, words get a ``▁`` prefix (Metaspace), and pairs are encoded
  as ``[CLS] A [SEP] B [SEP]`` with token type 1 on ``B [SEP]``.
- ``wordpiece`` (BERT, DistilBERT): ``[PAD] [UNK] [CLS] [SEP] [MASK]``, BERT's lowercasing normalizer
  and pre-tokenizer, ``##`` continuation pieces.
- ``bpe`` (RoBERTa, GPT-2): byte-level BPE (no unknown tokens), ``<s> <pad> </s> <unk> <mask>``,
  ``<s> A </s>`` for a single sequence; ``</s>`` ends a document for causal LM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from cotrain.data.errors import DataError
from cotrain.data.fsutil import check_replaceable, replace_dir, temp_dir_beside

logger = logging.getLogger(__name__)

PAD, UNK, CLS, SEP, MASK = "<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4, in this order
MODEL_MAX_LENGTH = 1_000_000
TOKENIZER_CONFIG = "tokenizer_config.json"  # in every folder save_pretrained writes
METASPACE = "▁"
TOKENIZER_TYPES = ("unigram", "wordpiece", "bpe")
Progress = int | None  # show the trainer's progress over this many texts (0: unknown); None: quiet
# the tokenizer type trained for an objective unless --tokenizer-type says otherwise
DEFAULT_TOKENIZER_TYPE = {"sop+mlm": "unigram", "mlm": "wordpiece", "clm": "bpe"}
# the special tokens each objective needs from its tokenizer
REQUIRED_TOKENS = {
    "sop+mlm": ("mask_token", "cls_token", "sep_token", "pad_token"),
    "mlm": ("mask_token", "cls_token", "sep_token", "pad_token"),
    "clm": ("eos_token",),
}
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BPE_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


def _build_backend(vocab_size: int, texts: Iterable[str], progress: Progress) -> Tokenizer:
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Lowercase(), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement=METASPACE)]
    )
    tokenizer.decoder = decoders.Metaspace(replacement=METASPACE)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token=UNK,
        max_piece_length=16,
        show_progress=progress is not None,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=progress or None)
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got ids {ids}, expected 0..4")
    cls_id, sep_id = ids[2], ids[3]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)],
    )
    return tokenizer


def _wrap(
    backend: Tokenizer,
    specials: tuple[str, str, str, str, str] = (UNK, PAD, CLS, SEP, MASK),
    names: tuple[str, ...] = ("input_ids", "token_type_ids", "attention_mask"),
) -> PreTrainedTokenizerFast:
    """A trained backend as a transformers tokenizer: ``specials`` = (unk, pad, cls, sep, mask); cls and sep
    also serve as bos and eos."""
    unk, pad, cls, sep, mask = specials
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=unk,
        pad_token=pad,
        cls_token=cls,
        sep_token=sep,
        mask_token=mask,
        bos_token=cls,
        eos_token=sep,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        model_input_names=list(names),
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """``save_pretrained`` into a temporary folder beside ``out_dir``, then rename it into place
    (an existing ``out_dir`` is replaced only once the new one is complete)."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir, TOKENIZER_CONFIG, "a saved tokenizer")
    tmp = temp_dir_beside(out_dir)
    try:
        tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, out_dir, TOKENIZER_CONFIG, "a saved tokenizer")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _build_wordpiece(vocab_size: int, texts: Iterable[str], progress: Progress) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(WORDPIECE_SPECIALS), show_progress=progress is not None
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=progress or None)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer


def _build_bpe(vocab_size: int, texts: Iterable[str], progress: Progress) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress is not None,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=progress or None)
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    return tokenizer


def _wrap_other(backend: Tokenizer, kind: str) -> PreTrainedTokenizerFast:
    if kind == "wordpiece":
        pad, unk, cls, sep, mask = WORDPIECE_SPECIALS
        return _wrap(backend, (unk, pad, cls, sep, mask))
    cls, pad, sep, unk, mask = BPE_SPECIALS
    return _wrap(backend, (unk, pad, cls, sep, mask), ("input_ids", "attention_mask"))


def train_tokenizer(
    texts: Iterable[str], kind: str, vocab_size: int, out_dir: str | Path, progress: Progress = None
) -> PreTrainedTokenizerFast:
    """Train a tokenizer of type ``kind`` (one of ``TOKENIZER_TYPES``) on ``texts`` and save it to
    ``out_dir`` atomically with ``save_pretrained``. With ``progress`` (the number of texts; 0 when
    unknown), the trainer shows its progress bars on stderr."""
    if kind == "unigram":
        return train_albert_tokenizer(texts, vocab_size, out_dir, progress)
    if kind not in TOKENIZER_TYPES:
        raise DataError(f"unknown tokenizer type {kind!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise DataError(f"vocab_size must be larger than {len(SPECIAL_TOKENS)}, got {vocab_size}")
    backend = (_build_wordpiece if kind == "wordpiece" else _build_bpe)(vocab_size, texts, progress)
    if backend.get_vocab_size() <= len(SPECIAL_TOKENS) + (256 if kind == "bpe" else 0):
        raise DataError("tokenizer training saw no text: the corpus is empty")
    tokenizer = _wrap_other(backend, kind)
    save_tokenizer(tokenizer, out_dir)
    logger.info("trained a %s tokenizer with %d tokens into %s", kind, len(tokenizer), out_dir)
    return tokenizer


def train_albert_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, progress: Progress = None
) -> PreTrainedTokenizerFast:
    """Train a Unigram (SentencePiece-style) tokenizer with ALBERT's special tokens on ``texts`` and
    save it to ``out_dir`` atomically. ``vocab_size`` includes the 5 special tokens; on a small
    corpus the trainer may stop below it. ``progress``: as for ``train_tokenizer``."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise DataError(f"vocab_size must be larger than {len(SPECIAL_TOKENS)}, got {vocab_size}")
    backend = _build_backend(vocab_size, texts, progress)
    if backend.get_vocab_size() <= len(SPECIAL_TOKENS):
        raise DataError("tokenizer training saw no text: the corpus is empty")
    tokenizer = _wrap(backend)
    save_tokenizer(tokenizer, out_dir)
    logger.info("trained a Unigram tokenizer with %d tokens into %s", len(tokenizer), out_dir)
    return tokenizer


def check_tokenizer(tokenizer: PreTrainedTokenizerFast, where: str, objective: str = "sop+mlm") -> None:
    """DataError unless the tokenizer is a fast one with the special tokens ``objective`` needs
    (``REQUIRED_TOKENS``: [MASK], [CLS], [SEP] and pad for the masked-LM objectives, an end-of-text
    token for causal LM)."""
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise DataError(f"tokenizer at {where} is not a fast (tokenizers) tokenizer; retrain it")
    required = REQUIRED_TOKENS.get(objective)
    if required is None:
        raise DataError(f"unknown objective {objective!r}; choose one of {', '.join(REQUIRED_TOKENS)}")
    missing = [
        name
        for name in required
        if getattr(tokenizer, name, None) is None or getattr(tokenizer, f"{name}_id", None) is None
    ]
    if missing:
        raise DataError(
            f"tokenizer at {where} lacks {', '.join(missing)}, which objective {objective} needs; "
            "train one with `cotrain prepare` (without --tokenizer)"
        )


def _is_hub_name(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name)) and not name.startswith(".")


def load_tokenizer(path: str | Path, objective: str = "sop+mlm") -> PreTrainedTokenizerFast:
    """Load a tokenizer saved with ``save_pretrained`` from a local folder, or a pretrained one by
    name from the Hugging Face Hub (``albert-large-v2``; needs a network), checking that it has the
    special tokens ``objective`` needs."""
    local = Path(path).is_dir()
    if not local and not (isinstance(path, str) and _is_hub_name(path) and not Path(path).exists()):
        raise DataError(f"no tokenizer at {path}: give a folder written by save_pretrained")
    path = Path(path) if local else path
    try:
        if local and (path / "tokenizer.json").is_file():
            # a fast tokenizer's own file: no need for AutoTokenizer, whose import pulls in torch
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=local)
    except Exception as e:  # tokenizers raises bare Exceptions for corrupt files
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"cannot load tokenizer at {path} ({type(e).__name__}: {detail}); is it corrupt? "
            "prepare again without --tokenizer to train a new one"
        ) from None
    check_tokenizer(tokenizer, str(path), objective)
    return tokenizer


def tokenizer_hash(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 of the tokenizer's content (model, normalizer, pre-/post-processor, decoder, added
    tokens and the special-token roles), independent of where it is stored and of transient
    truncation/padding settings."""
    content = json.loads(tokenizer.backend_tokenizer.to_str())
    content.pop("truncation", None)
    content.pop("padding", None)
    canonical = {
        "backend": content,
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    blob = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
