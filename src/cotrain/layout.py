"""A model's layout without its code: the names, shapes and dtypes of its parameters, and which of them are
tied (one tensor under two names, as a vocabulary head shares the input embedding).

The monitor holds, checkpoints and serves the swarm's state but never computes with it; transformers' model
code would cost its process about 100 MB (``transformers.modeling_utils`` and the family's module), so its
state keeper (cotrain.roles.keeper) holds the state in a ``LayoutModel`` instead: a module of the same
parameters under the same names, in the same order, tied the same way. Its ``state_dict`` has the real model's
keys and shapes, so its checkpoints load into the real model and back, and hivemind's state averager sees the
same tensors in the same order as the trainers' do.

The layout is read in a short-lived child process (``python -m cotrain.layout``) that builds the model on the
meta device (from ``--init-from``'s folder, on the CPU) and prints ``describe(model)`` as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import torch

from cotrain.config import RunConfig
from cotrain.errors import UserError

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


def read_layout(
    run: RunConfig,
    vocab_size: int,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> list[dict]:
    """The layout of the run's model, read in a child process (this one imports no model code)."""
    request = {
        "run": dataclasses.asdict(run),
        "vocab_size": vocab_size,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "cotrain.layout"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"reading the model's layout took over {TIMEOUT} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise UserError(f"cannot read the model's layout: {why}")
    return json.loads(done.stdout)


def layout_model(run: RunConfig, tokenizer: Any) -> LayoutModel:
    """A LayoutModel of the run's model for ``tokenizer`` (its vocabulary size and special token ids)."""
    return LayoutModel(
        read_layout(
            run,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def main() -> None:
    """``python -m cotrain.layout``: a request (JSON on stdin) -> the model's layout (JSON on stdout)."""
    from cotrain.models import build_model

    request = json.loads(sys.stdin.read())
    run = RunConfig.from_dict(request.pop("run"))
    try:
        if run.init_from:  # from_pretrained reads the folder's weights: on the CPU
            model = build_model(run, **request)
        else:
            with torch.device("meta"):
                model = build_model(run, **request)
        entries = describe(model)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    json.dump(entries, sys.stdout)


if __name__ == "__main__":
    main()
