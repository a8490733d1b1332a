"""Checkpoints on disk: save, verify, find the newest good one, load, keep the last K, export.

A checkpoint is a folder ``step-000123/`` holding

- ``model.safetensors``: the model's weights (full precision),
- ``optimizer.safetensors``: the optimizer's tensors (LAMB/Adam moments; with ``--strategy diloco``, the
  outer optimizer's momentum), named ``KEY/PARAMETER``,
- ``inner_optimizer.safetensors`` (diloco only): the inner optimizer's tensors, named the same way,
- ``tokenizer/``: the tokenizer's files (``save_pretrained``), so a checkpoint is self-contained,
- ``checkpoint.json``: the global step, the resolved config, the tokenizer hash, the optimizer's scalars and
  parameter groups, the scheduler's state (diloco: the inner optimizer's and its schedule's under
  ``inner``), and the sha256 of every other file (checked on load).

It is written into a temporary folder beside its final place, every file fsynced, then renamed: a crash
leaves either a complete checkpoint or a ``.step-000123.tmp-*`` folder that is never read (and is removed the
next time a checkpoint is saved there).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from cotrain import faults
from cotrain.config import RunConfig
from cotrain.data.errors import DataError
from cotrain.data.fsutil import (
    check_replaceable,
    foreign_entry,
    inside,
    replace_dir,
    sha256_file,
    small_json,
    temp_dir_beside,
)
from cotrain.data.manifest import Sha256, first_problem, matching
from cotrain.errors import UserError
from cotrain.families import FAMILIES

logger = logging.getLogger(__name__)

FORMAT = "cotrain-checkpoint/1"
META = "checkpoint.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
INNER_OPTIMIZER = "inner_optimizer.safetensors"
TOKENIZER = "tokenizer"
EXPORT_MARKER = "cotrain.json"  # in every folder `cotrain export` writes, naming the files it wrote
MAX_EXPORT_MARKER_BYTES = 1 << 20
# what exports made before cotrain.json named its files may hold: save_pretrained's files of the families
EXPORT_FILES = re.compile(
    r"(?:generation_)?config\.json|model(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer(?:_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.(?:txt|json)"
    r"|merges\.txt|spiece\.model|tokenizer\.model|chat_template\.(?:jinja|json)"
)
MAX_META_BYTES = 64 << 20  # checkpoint.json holds the config and the optimizer's scalars: a few MB at most
NAME = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, truncated, corrupted or made for another model."""


# a file of the checkpoint, relative to its folder: up to four plain path components (tokenizer/vocab.txt),
# each like a manifest's file names (no "..", no separator, nothing empty)
_PART = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"
RelativeFile = Annotated[
    str, AfterValidator(matching(rf"(?:{_PART}/){{0,3}}{_PART}", "a path inside the checkpoint"))
]


class _OptimizerMeta(BaseModel):
    model_config = ConfigDict(strict=True)
    param_groups: list[dict[str, Any]]
    scalars: dict[str, dict[str, Any]]


class _InnerMeta(BaseModel):
    model_config = ConfigDict(strict=True)
    optimizer: _OptimizerMeta
    scheduler: dict[str, Any] | None = None


class CheckpointMeta(BaseModel):
    """``checkpoint.json``, as save_checkpoint writes it (unknown keys are ignored)."""

    model_config = ConfigDict(strict=True)
    format: Literal["cotrain-checkpoint/1"]
    step: Annotated[int, Field(ge=0)]
    source: str = ""
    created: str = ""
    run_id: str = ""
    config: dict[str, Any]
    tokenizer_hash: Sha256
    optimizer: _OptimizerMeta
    scheduler: dict[str, Any] | None
    inner: _InnerMeta | None = None
    files: Annotated[dict[RelativeFile, Sha256], Field(max_length=256)]


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders under ``root``, oldest first (temporary folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def parameter_names(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None = None
) -> list[str]:
    """The model's name of each parameter the optimizer holds, in the optimizer's (state_dict index) order.

    ``params``: the model's parameters in that order, when the optimizer holds copies of them (hivemind's
    offloaded optimizer: ``state_averager.main_parameters``)."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    order = params if params is not None else [p for group in optimizer.param_groups for p in group["params"]]
    names = [by_id.get(id(p)) for p in order]
    assert None not in names, "the optimizer holds a parameter that is not the model's; pass params="
    assert len(names) == sum(len(g["params"]) for g in optimizer.param_groups), "params do not match"
    return names  # type: ignore[return-value]


def _optimizer_parts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    names = parameter_names(model, optimizer, params)
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        name = names[index]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{key}/{name}"] = value.detach().cpu().contiguous().clone()
            else:
                scalars.setdefault(name, {})[key] = value
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fault(point: str, root: Path, tmp: Path) -> None:
    """A crash point of the fault tests (see cotrain.faults: COTRAIN_FAULT=checkpoint-before-rename[:N])."""

    if faults.crash_point(point, len(list_checkpoints(root))):
        logger.error(f"Fault injection {point!r}: exiting before renaming {tmp}")
        logging.shutdown()
        os._exit(17)


def save_checkpoint(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    config: dict,
    tokenizer: Any,
    keep: int = 3,
    source: str = "",
    params: Sequence[torch.Tensor] | None = None,
    inner: tuple[torch.optim.Optimizer, Any] | None = None,
) -> Path:
    """Write a checkpoint of ``step`` atomically under ``root``; keep the newest ``keep``. Returns its folder.
    ``inner``: DiLoCo's inner (optimizer, scheduler), saved beside the (outer) ``optimizer``.

    The caller holds whatever lock keeps the model and the optimizer still while this copies them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.tmp-*"):  # left by a crash mid-write
        logger.info(f"Removing the incomplete checkpoint {stale.name} (a save was interrupted)")
        shutil.rmtree(stale, ignore_errors=True)
    final = step_dir(root, step)
    if final.exists() and not (final / META).is_file():
        raise CheckpointError(f"{final} exists and is not a checkpoint: move it away (nothing was written)")
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / MODEL))
        opt_tensors, opt_meta = _optimizer_parts(model, optimizer, params)
        save_file(opt_tensors, str(tmp / OPTIMIZER))
        inner_meta = None
        if inner is not None:
            inner_tensors, inner_opt_meta = _optimizer_parts(model, inner[0], None)
            save_file(inner_tensors, str(tmp / INNER_OPTIMIZER))
            inner_meta = {"optimizer": inner_opt_meta, "scheduler": _scheduler_state(inner[1])}
        tokenizer.save_pretrained(str(tmp / TOKENIZER))
        files = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {
            "format": FORMAT,
            "step": int(step),
            "source": source,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "run_id": config.get("run", {}).get("run_id", ""),
            "config": config,
            "tokenizer_hash": content_hash(tokenizer),
            "optimizer": opt_meta,
            "scheduler": _scheduler_state(scheduler),
            "inner": inner_meta,
            "files": files,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1, default=_json_default))
        _fsync_tree(tmp)
        _fault("checkpoint-before-rename", root, tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_tree(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return final


def _scheduler_state(scheduler: Any) -> dict | None:
    return scheduler.state_dict() if scheduler is not None else None


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple | set):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in checkpoint.json")


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints under ``root`` (only folders that hold a checkpoint's
    metadata: a folder merely named like one is left alone)."""
    ours = [p for p in list_checkpoints(root) if (p / META).is_file()]
    for old in ours[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
        logger.debug(f"Removed old checkpoint {old}")


def verify(path: str | Path) -> dict:
    """Read a checkpoint's metadata and check every file against its recorded sha256.

    Raises CheckpointError saying what is wrong (missing, truncated or corrupted file)."""
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {META} (an incomplete or foreign folder)")
    if meta_path.stat().st_size > MAX_META_BYTES:
        raise CheckpointError(f"checkpoint {path}: {META} is larger than {MAX_META_BYTES >> 20} MiB")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} is corrupted ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {META} is not a {FORMAT} file")
    try:
        meta = CheckpointMeta.model_validate(meta).model_dump()
    except ValidationError as e:
        raise CheckpointError(f"checkpoint {path}: {META} is corrupted ({first_problem(e)})") from None
    for name, digest in meta["files"].items():
        try:
            file = inside(path, name)
        except DataError:
            raise CheckpointError(f"checkpoint {path}: {name} points outside the checkpoint") from None
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks {name}")
        if sha256_file(file) != digest:
            raise CheckpointError(f"checkpoint {path}: {name} is truncated or corrupted (sha256 mismatch)")
    for needed in (MODEL, OPTIMIZER):
        if needed not in meta["files"]:
            raise CheckpointError(f"checkpoint {path} does not record {needed}")
    return meta


def latest_good(root: str | Path) -> tuple[Path, dict] | None:
    """The newest checkpoint under ``root`` that verifies, skipping bad ones with one log line each."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, verify(path)
        except CheckpointError as e:
            logger.warning(f"Skipping a bad checkpoint: {e}; trying the previous one")
    return None


def content_hash(tokenizer: Any) -> str:
    """The hash a checkpoint records of its tokenizer (cotrain.data.tokenizer.tokenizer_hash); a tokenizer
    held as its saved files (cotrain.host.layout.SavedTokenizer, the monitor's) carries it."""
    known = getattr(tokenizer, "content_hash", None)
    if known is not None:
        return known
    from cotrain.data.tokenizer import tokenizer_hash  # transformers: only where a tokenizer is loaded

    return tokenizer_hash(tokenizer)


def checkpoint_tokenizer(path: str | Path, meta: dict) -> Any:
    from cotrain.data.tokenizer import load_tokenizer  # deferred: transformers, where a model is built

    objective = meta.get("config", {}).get("run", {}).get("objective", "sop+mlm")
    return load_tokenizer(Path(path) / TOKENIZER, objective)


def load_into(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    meta: dict | None = None,
    params: Sequence[torch.Tensor] | None = None,
    inner: tuple[torch.optim.Optimizer, Any] | None = None,
) -> dict:
    """Load a checkpoint (verified unless ``meta`` is given) into a model built with the same shapes, and
    its optimizer and scheduler. Returns the checkpoint's metadata. With ``params`` (the model's parameters
    in the optimizer's order, for an optimizer holding copies of them), the copies get the loaded weights.
    ``inner``: DiLoCo's inner (optimizer, scheduler), loaded when the checkpoint has them."""
    path = Path(path)
    meta = meta if meta is not None else verify(path)
    try:
        with torch.no_grad():
            load_model(model, str(path / MODEL), strict=True)
    except (RuntimeError, SafetensorError) as e:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({str(e).splitlines()[0]}); "
            "was it made with another preset or tokenizer?"
        ) from None
    if optimizer is not None:
        _load_optimizer(path, model, optimizer, params, OPTIMIZER, meta["optimizer"])
        if params is not None:
            copies = [p for group in optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                for copy, param in zip(copies, params, strict=True):
                    if copy is not param:
                        copy.copy_(param)
    if scheduler is not None and meta.get("scheduler"):
        scheduler.load_state_dict(meta["scheduler"])
    if inner is not None and meta.get("inner"):
        _load_optimizer(path, model, inner[0], None, INNER_OPTIMIZER, meta["inner"]["optimizer"])
        if inner[1] is not None and meta["inner"].get("scheduler"):
            inner[1].load_state_dict(meta["inner"]["scheduler"])
    return meta


def _load_optimizer(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor] | None,
    filename: str,
    opt_meta: dict,
) -> None:
    names = parameter_names(model, optimizer, params)
    index = {name: i for i, name in enumerate(names)}
    tensors = load_file(str(path / filename))
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        kind, _, name = key.partition("/")
        state.setdefault(index[name], {})[kind] = tensor
    for name, scalars in opt_meta["scalars"].items():
        state.setdefault(index[name], {}).update(scalars)
    groups = [dict(g, params=[index[n] for n in g["params"]]) for g in opt_meta["param_groups"]]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise CheckpointError(f"checkpoint {path} has other optimizer parameter groups than this model")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model weights, optimizer tensors) of a checkpoint, by name, without building a model."""
    path = Path(path)
    return load_file(str(path / MODEL)), load_file(str(path / OPTIMIZER))


def build_from_checkpoint(path: str | Path, meta: dict) -> tuple[torch.nn.Module, Any]:
    """The checkpoint's model (weights loaded) and its tokenizer."""
    from cotrain.models import model_for_tokenizer  # deferred: transformers, where a model is built

    tokenizer = checkpoint_tokenizer(path, meta)
    if content_hash(tokenizer) != meta.get("tokenizer_hash"):
        raise CheckpointError(f"checkpoint {path}: its tokenizer does not match the recorded hash")
    run = RunConfig.from_dict(meta["config"]["run"])
    model = model_for_tokenizer(run, tokenizer)
    load_into(path, model, meta=meta)
    model.eval()
    return model, tokenizer


def why_not_exported(folder: Path) -> str | None:
    """None when ``folder`` is one that ``cotrain export`` wrote (so that the next export may replace it): its
    ``cotrain.json`` is an export's, and it holds nothing but the files that ``cotrain.json`` names (or, for
    an export that named none, the files ``save_pretrained`` writes). Otherwise the reason, in a few words."""
    marker = folder / EXPORT_MARKER
    try:
        content = small_json(marker, MAX_EXPORT_MARKER_BYTES)
    except FileNotFoundError:
        return f"it has no {EXPORT_MARKER}"
    except ValueError:
        return f"its {EXPORT_MARKER} is not an export's"
    if not isinstance(content, dict) or not isinstance(content.get("auto_class"), str):
        return f"its {EXPORT_MARKER} is not an export's"
    files = content.get("files")
    if files is None:
        written = EXPORT_FILES.fullmatch
    elif isinstance(files, list) and all(isinstance(name, str) for name in files):
        written = set(files).__contains__
    else:
        return f"its {EXPORT_MARKER} is not an export's"
    stray = foreign_entry(folder, lambda name: name == EXPORT_MARKER or bool(written(name)))
    if stray is not None:
        return f"it holds {stray!r}, which `cotrain export` does not write"
    return None


def export(checkpoint: str | Path, out_dir: str | Path, local_path: bool = True) -> Path:
    """Write a Hugging Face model folder (config.json, model.safetensors, tokenizer files) that the
    family's Auto class loads (``AutoModelForPreTraining`` for ALBERT, ``AutoModelForMaskedLM`` for BERT,
    DistilBERT and RoBERTa, ``AutoModelForCausalLM`` for GPT-2, Llama and Qwen2). Written beside ``out_dir``,
    then renamed. Its ``cotrain.json`` names the checkpoint by its full path, or with ``local_path`` False (a
    folder that leaves this machine) by its folder name only."""

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    # a folder holding anything an export does not write is refused, untouched
    check_replaceable(out_dir, EXPORT_MARKER, "a cotrain export", why_not_exported)
    if checkpoint.is_dir() and not (checkpoint / META).exists():  # a checkpoints folder: its newest good one
        found = latest_good(checkpoint)
        if found is None:
            raise CheckpointError(f"no good checkpoint in {checkpoint}")
        checkpoint = found[0]
    meta = verify(checkpoint)
    model, tokenizer = build_from_checkpoint(checkpoint, meta)
    family = FAMILIES[model.config.model_type]
    auto_class = family.auto_class
    # the exported tokenizer makes only the inputs the model takes (DistilBERT has no token types)
    tokenizer.model_input_names = [n for n in tokenizer.model_input_names if n in family.inputs]
    tmp = temp_dir_beside(out_dir)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        files = sorted([p.name for p in tmp.iterdir()] + [EXPORT_MARKER])
        (tmp / EXPORT_MARKER).write_text(
            json.dumps(
                {
                    "step": meta["step"],
                    "run_id": meta.get("run_id"),
                    "checkpoint": str(checkpoint) if local_path else checkpoint.name,
                    "auto_class": auto_class,
                    "files": files,
                }
            )
        )
        replace_dir(tmp, out_dir, EXPORT_MARKER, "a cotrain export", why_not_exported)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        f"Exported {checkpoint} (global step {meta['step']}) to {out_dir}: "
        f"transformers.{auto_class}.from_pretrained({str(out_dir)!r}) loads it"
    )
    return out_dir
