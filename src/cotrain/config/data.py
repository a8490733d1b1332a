"""Where a peer's data comes from (a prepared dataset folder or URL, its tokenizer, a model config file), and
`cotrain prepare`'s options for making such a dataset."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import opt


@dataclass
class DataConfig:
    """Data: this peer's prepared dataset (a folder or a URL), its tokenizer and the model's config file."""

    TITLE: ClassVar[str] = "data"

    dataset_path: str = opt(
        "",
        "Folder made by `cotrain prepare` (the monitor reads only its manifest and tokenizer).",
        roles=("train", "eval", "monitor"),
        seed="--dataset_path",
    )
    dataset_url: str = opt(
        "",
        "URL of a folder made by `cotrain prepare` on any HTTP(S) server; shards download as training goes. "
        "Its manifest must be the one the initial peer trains with (its config record says which).",
        roles=("train", "eval", "monitor"),
    )
    cache_dir: str = opt(
        "",
        "Where shards fetched from --dataset-url are cached (default: ~/.cache/cotrain/datasets).",
        roles=("train", "eval", "monitor"),
        seed="--cache_dir",
    )
    tokenizer_path: str = opt(
        "",
        "Tokenizer folder (save_pretrained): the monitor's model shapes instead of the dataset's; a "
        "trainer checks it is the tokenizer its dataset was prepared with.",
        flags=("--tokenizer",),
        roles=("train", "monitor"),
        seed=("--tokenizer_path", "--tokenizer"),
    )
    model_config_path: str = opt(
        "",
        "Model architecture from a JSON file, a Hugging Face model folder (its config.json) or a URL; it "
        "overrides the preset's [run.model] (give every peer the same).",
        flags=("--config-path",),
        roles=("train", "monitor", "eval"),
        seed=("--model_config_path", "--config_path"),
    )

    def problems(self) -> list[str]:
        return []


@dataclass
class PrepareConfig:
    """Options of `cotrain prepare` (turning a corpus into training examples)."""

    TITLE: ClassVar[str] = "prepare"

    demo_corpus: bool = opt(
        False, "Use the built-in demo corpus (text that ships with Python).", roles=("prepare",)
    )
    text_files: list = opt(
        [], "Local text files or globs (WikiText format is recognised).", roles=("prepare",)
    )
    output: str = opt("data", "Folder to write the prepared dataset to.", roles=("prepare",))
    tokenizer: str = opt(
        "", "Pretrained tokenizer folder; a new one is trained when empty.", roles=("prepare",)
    )
    vocab_size: int = opt(8000, "Vocabulary size of a tokenizer trained here.", roles=("prepare", "demo"))
    valid_fraction: float = opt(0.02, "Fraction of documents held out for evaluation.", roles=("prepare",))
    objective: str = opt(
        "", "Examples to make: sop+mlm, mlm or clm (default: the preset's objective).", roles=("prepare",)
    )
    tokenizer_type: str = opt(
        "",
        "Tokenizer to train: unigram (ALBERT), wordpiece (BERT, DistilBERT) or bpe (RoBERTa, GPT-2); "
        "default: the preset's family's (with another --objective, that objective's).",
        roles=("prepare",),
    )
    train_tokenizer: bool = opt(
        False, "Train a tokenizer on the corpus (the default without --tokenizer).", roles=("prepare",)
    )
    dataset: str = opt(
        "",
        "Hugging Face dataset name (needs a network) or a local folder of parquet/json/text files.",
        roles=("prepare",),
    )
    dataset_config: str = opt("", "Configuration of --dataset (e.g. wikitext-103-v1).", roles=("prepare",))
    dataset_split: str = opt("train", "Split of --dataset to read.", roles=("prepare",))
    recipe_data: str = opt(
        "",
        "Data tokenized by the original recipe: a save_to_disk folder or .tar/.tar.gz, a path or a URL.",
        roles=("prepare",),
    )
    shard_size: int = opt(10000, "Examples per shard of the prepared dataset.", roles=("prepare",))
    num_proc: int = opt(1, "Worker processes that make examples.", roles=("prepare",))

    def problems(self) -> list[str]:
        problems = []
        if not 0 <= self.valid_fraction < 1:
            problems.append(f"valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.vocab_size < 100:
            problems.append(f"vocab_size must be at least 100, got {self.vocab_size}")
        if self.shard_size < 1 or self.num_proc < 1:
            problems.append("shard_size and num_proc must be at least 1")
        return problems
