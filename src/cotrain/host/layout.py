"""A model's layout without its code: the names, shapes and dtypes of its parameters, and which of them are
tied (one tensor under two names, as a vocabulary head shares the input embedding).

The monitor holds, checkpoints and serves the swarm's state but never computes with it; transformers' model
code would cost its process about 100 MB (``transformers.modeling_utils`` and the family's module), so its
state keeper (cotrain.roles.keeper) holds the state in a ``LayoutModel`` instead: a module of the same
parameters under the same names, in the same order, tied the same way. Its ``state_dict`` has the real model's
keys and shapes, so its checkpoints load into the real model and back, and hivemind's state averager sees the
same tensors in the same order as the trainers' do.

The layout is read in a short-lived child process (``python -m cotrain.host.layout``) that builds the model
on the meta device (from ``--init-from``'s folder, on the CPU) and prints ``describe(model)`` as JSON.

The monitor holds the run's tokenizer the same way: its checkpoints carry the tokenizer's files and content
hash, and loading a tokenizer imports transformers (with the data layer's pyarrow, 44 MiB of the monitor's
PSS). ``run_state_layout`` has the child find the run's tokenizer as the monitor would (``--tokenizer-path``,
the dataset's, or with ``--resume`` the newest good checkpoint's), save it into a folder of the monitor's
(``save_pretrained``), and report its content hash with the layout of the run's model for it (its vocabulary
size, its special ids): the monitor holds a ``SavedTokenizer``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from cotrain.config import Config, RunConfig
from cotrain.errors import UserError

NO_LAYOUT = "cannot read the model's layout"
TIMEOUT = 600  # seconds the child may take: importing transformers, or loading a pretrained folder


def describe(model: torch.nn.Module) -> list[dict]:
    """Each entry of the model's ``state_dict``, in its order: name, shape, dtype, and ``same_as``, the name
    of the tensor it is tied to (its first name in ``named_parameters``), or None. A persistent buffer (a
    value the layout cannot carry) is refused."""
    first_name = {id(p): name for name, p in model.named_parameters()}
    entries = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in first_name:
            raise UserError(f"{type(model).__name__}.{name} is a persistent buffer: it has no layout")
        first = first_name[id(tensor)]
        entries.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "same_as": None if first == name else first,
            }
        )
    return entries


class LayoutModel(torch.nn.Module):
    """A module holding the parameters of a layout (zeros), under their names, tied as described."""

    def __init__(self, entries: list[dict]) -> None:
        super().__init__()
        made: dict[str, torch.nn.Parameter] = {}
        for entry in entries:
            name = entry["name"]
            if entry["same_as"] is not None:
                param = made[entry["same_as"]]
            else:
                param = torch.nn.Parameter(torch.zeros(entry["shape"], dtype=getattr(torch, entry["dtype"])))
                made[name] = param
            *path, leaf = name.split(".")
            self._submodule(path).register_parameter(leaf, param)

    def _submodule(self, path: list[str]) -> torch.nn.Module:
        module: torch.nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        return module


def _ask_child(request: dict) -> Any:
    """Run ``python -m cotrain.host.layout`` on ``request``; its answer, or its error as one UserError."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cotrain.host.layout"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"reading the model's layout took over {TIMEOUT} s") from None
    if done.returncode != 0:  # 2: the child's own one-line error; else it crashed
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = lines[-1].removeprefix("error: ") if lines else f"exit status {done.returncode}"
        raise UserError(why if done.returncode == 2 else f"{NO_LAYOUT}: {why}")
    return json.loads(done.stdout)


@dataclasses.dataclass(frozen=True)
class SavedTokenizer:
    """A tokenizer held as its saved files and content hash, for a process that only stores it (the monitor):
    ``save_pretrained`` copies the files (as a loaded tokenizer writes them); ``content_hash`` is
    cotrain.data.tokenizer.tokenizer_hash of the tokenizer they hold."""

    folder: Path
    content_hash: str

    def save_pretrained(self, out_dir: str) -> None:
        shutil.copytree(self.folder, out_dir)


def run_state_layout(
    config: Config, checkpoints: Path, save_to: Path
) -> tuple[SavedTokenizer, LayoutModel] | None:
    """The run's tokenizer, saved into ``save_to``, and a LayoutModel of the run's model for it; None where
    there is no tokenizer to be had (no --tokenizer-path, dataset or checkpoint to resume)."""
    answer = _ask_child(
        {
            "config": config.to_dict(),
            "checkpoints": str(checkpoints),
            "save_to": str(save_to),
        }
    )
    if answer is None:
        return None
    return SavedTokenizer(Path(save_to), answer["content_hash"]), LayoutModel(answer["entries"])


def find_run_tokenizer(config: Config, checkpoints: Path) -> Any | None:
    """The run's tokenizer: --tokenizer-path, the dataset's (--dataset-path or --dataset-url), or with
    --resume the newest good checkpoint's under ``checkpoints``; None if there is none."""
    from cotrain.data import load_tokenizer, read_manifest  # deferred: transformers, for a layout check only

    run, peer = config.run, config.peer
    if peer.tokenizer_path:
        return load_tokenizer(peer.tokenizer_path, run.objective)
    if peer.dataset_path:
        read_manifest(peer.dataset_path)  # a clear error when it is not a prepared dataset
        return load_tokenizer(Path(peer.dataset_path) / "tokenizer", run.objective)
    if peer.dataset_url:
        from cotrain.data import ExampleStream  # deferred: transformers, for a layout check only

        stream = ExampleStream(peer.dataset_url, cache_dir=peer.cache_dir or None, prefetch=-1)
        stream.close()  # only its manifest and tokenizer were needed
        return stream.tokenizer
    if peer.resume:
        from cotrain import checkpoints as ck  # deferred: transformers, for a layout check only

        found = ck.latest_good(checkpoints)
        if found is not None:
            return ck.checkpoint_tokenizer(*found)
    return None


def _state_layout(request: dict) -> dict | None:
    """The child's side of run_state_layout."""
    from cotrain.config import config_from_dict  # deferred: transformers, for a layout check only
    from cotrain.data.tokenizer import save_tokenizer, tokenizer_hash  # deferred

    config = config_from_dict(request["config"])
    tokenizer = find_run_tokenizer(config, Path(request["checkpoints"]))
    if tokenizer is None:
        return None
    entries = _built_layout(
        config.run,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    save_tokenizer(tokenizer, request["save_to"])
    return {"content_hash": tokenizer_hash(tokenizer), "entries": entries}


def _built_layout(run: RunConfig, **ids: Any) -> list[dict]:
    """Build the run's model (vocabulary size and special ids in ``ids``) and describe it."""
    from cotrain.models import build_model  # deferred: transformers, for a layout check only

    try:
        if run.init_from:  # from_pretrained reads the folder's weights: on the CPU
            model = build_model(run, **ids)
        else:
            with torch.device("meta"):
                model = build_model(run, **ids)
        return describe(model)
    except UserError as e:
        raise UserError(f"{NO_LAYOUT}: {e}") from None


def main() -> None:
    """``python -m cotrain.host.layout``: a request (JSON on stdin: the run's config, where its checkpoints
    are, where to save the tokenizer) -> the run's tokenizer saved and the model's layout for it (JSON on
    stdout; run_state_layout)."""
    request = json.loads(sys.stdin.read())
    try:
        answer = _state_layout(request)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
