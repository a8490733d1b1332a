"""A model architecture from a JSON model config (--model-config-path), as [run.model] keys."""

from __future__ import annotations

import json
from pathlib import Path

from cotrain.errors import UserError

MAX_MODEL_CONFIG_BYTES = 1 << 20  # a model's config.json is a few KB: 1 MiB bounds what a URL may send

# keys of a Hugging Face config.json that are not architecture: the tokenizer gives the vocabulary and
# special ids, the rest is bookkeeping
NOT_ARCHITECTURE = {
    "architectures",
    "model_type",
    "transformers_version",
    "vocab_size",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "id2label",
    "label2id",
}


def model_config_overrides(path: str, family: str, problems: list[str]) -> dict:
    """The architecture in a JSON model config (a file, a Hugging Face model folder's config.json or a
    URL), as [run.model] keys; problems are appended, not raised."""
    try:
        if path.startswith(("http://", "https://")):
            from cotrain.data.fetch import fetch_bytes

            text = fetch_bytes(path, MAX_MODEL_CONFIG_BYTES).decode()
        else:
            p = Path(path).expanduser()
            text = (p / "config.json" if p.is_dir() else p).read_text()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, UserError) as e:
        problems.append(f"model_config_path {path}: cannot read a JSON model config ({e})")
        return {}
    if not isinstance(data, dict):
        problems.append(f"model_config_path {path}: expected a JSON object")
        return {}
    model_type = data.get("model_type")
    if model_type and model_type.replace("-", "") != family:
        problems.append(
            f"model_config_path {path} is a {model_type!r} config, but the preset trains {family!r}"
        )
        return {}
    return {k: v for k, v in data.items() if k not in NOT_ARCHITECTURE}
