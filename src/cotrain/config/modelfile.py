"""A model architecture from a JSON model config (--model-config-path), as [run.model] keys.

The file is checked as far as it can be without transformers: a JSON object, a string ``model_type`` of the
preset's family, and each key that the preset's [run.model] also sets of that key's JSON type (an integer,
a number, true or false, a string, a list, an object). Every other key is checked by the family's config
class when the model is built (cotrain.models.model_config), again in one line."""

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


def json_kind(value: object) -> str:
    """A JSON value's type, as a problem names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _fits(value: object, like: object) -> bool:
    """Whether ``value`` has the JSON type of ``like`` (an integer is a number too; null fits anything)."""
    want, got = json_kind(like), json_kind(value)
    return like is None or got == want or (want == "a number" and got == "an integer")


def model_config_overrides(
    path: str, family: str, problems: list[str], preset_model: dict | None = None
) -> dict:
    """The architecture in a JSON model config (a file, a Hugging Face model folder's config.json or a
    URL), as [run.model] keys; problems are appended, not raised. ``preset_model``: the [run.model] table it
    overrides, whose values' types its keys must have."""
    try:
        if path.startswith(("http://", "https://")):
            from cotrain.data.fetch import fetch_bytes  # deferred: a model file given by URL only

            text = fetch_bytes(path, MAX_MODEL_CONFIG_BYTES).decode()
        else:
            p = Path(path).expanduser()
            text = (p / "config.json" if p.is_dir() else p).read_text()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, UserError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        problems.append(f"model_config_path {path}: cannot read a JSON model config ({reason})")
        return {}
    if not isinstance(data, dict):
        problems.append(f"model_config_path {path}: expected a JSON object")
        return {}
    model_type = data.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        problems.append(f"model_config_path {path}: model_type must be a string, got {json_kind(model_type)}")
        return {}
    if model_type and model_type.replace("-", "") != family:
        problems.append(
            f"model_config_path {path} is a {model_type!r} config, but the preset trains {family!r}"
        )
        return {}
    architecture = {k: v for k, v in data.items() if k not in NOT_ARCHITECTURE}
    for key, value in architecture.items():
        like = (preset_model or {}).get(key)
        if not _fits(value, like):
            problems.append(
                f"model_config_path {path}: {key} must be {json_kind(like)} (as in the preset), "
                f"got {json_kind(value)} {value!r:.60}"
            )
    return architecture
