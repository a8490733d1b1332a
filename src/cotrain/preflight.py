"""What a monitor's model must agree with, checked by its supervisor before any process or port starts.

A monitor keeps the swarm's checkpoints in the run's model, whose shapes come from its preset. Given a
prepared dataset (``--dataset-path`` or ``--dataset-url``) it learns the run's tokenizer from it, and with
``--resume`` it loads its newest checkpoint: a preset that differs from the one they were made for ran a
different model silently (a dataset prepared for albert-tiny under the default albert-large-v2), or failed
only after the DHT and the dashboard were up. Here, where the user named no preset, the monitor takes the one
the dataset or checkpoint was made for (and says so); where the user named another one, it is refused in one
line.

Only light reads (JSON files, a manifest over HTTP): the supervisor imports neither torch nor hivemind.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cotrain.config import Config
from cotrain.errors import UserError

CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")


def dataset_preset(source: str) -> tuple[str, str]:
    """The preset a prepared dataset (a folder, or the URL of one) was made for ("" when its manifest does
    not say, or a server cannot be reached now: the monitor then reports that itself) and its objective."""
    from cotrain.data import DataError, read_manifest  # deferred: a dataset's check only
    from cotrain.data.fetch import fetch_bytes, is_url  # deferred: a dataset's check only
    from cotrain.data.manifest import MANIFEST, MAX_MANIFEST_BYTES, parse_manifest  # deferred

    if is_url(source):
        url = source.rstrip("/") + "/" + MANIFEST
        try:
            manifest = parse_manifest(fetch_bytes(url, MAX_MANIFEST_BYTES), url)
        except DataError:
            return "", ""
    else:
        manifest = read_manifest(source)
    preset = (manifest.get("config") or {}).get("preset") or ""
    return (preset if isinstance(preset, str) else ""), str(manifest.get("objective", ""))


def checkpoint_preset(root: Path) -> tuple[str, Path] | None:
    """The preset of the newest checkpoint under ``root`` whose checkpoint.json names one (its files are
    verified later, when it is loaded), with its folder; None when there is none."""
    if not root.is_dir():
        return None
    steps = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := CHECKPOINT_NAME.match(p.name))
    )
    for _, folder in reversed(steps):
        try:
            meta = json.loads((folder / "checkpoint.json").read_text())
            preset = meta["config"]["run"]["preset"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(preset, str) and preset:
            return preset, folder
    return None


def monitor_preset(config: Config) -> tuple[str, str] | None:
    """The preset this monitor must run when its dataset or checkpoint names another one than its config's,
    with where it comes from; None when they agree (or say nothing). Raises UserError when the user named a
    preset that disagrees with them."""
    peer, run = config.peer, config.run
    chosen = "preset" in config.run_given
    if peer.dataset_path or peer.dataset_url:
        where = peer.dataset_path or peer.dataset_url
        preset, objective = dataset_preset(where)
        source = f"the dataset at {where}"
        if preset and preset != run.preset:
            if chosen:
                raise UserError(
                    f"{source} was prepared for preset {preset}, this monitor runs preset {run.preset}: pass "
                    f"--preset {preset} (or prepare a dataset with --preset {run.preset})"
                )
            return preset, source
        if not preset and objective and objective != run.objective:
            raise UserError(
                f"{source} holds {objective} examples, preset {run.preset} trains with {run.objective}: pass "
                "the preset the dataset was prepared for with --preset"
            )
    if peer.resume:
        found = checkpoint_preset(Path(peer.output_dir) / "checkpoints")
        if found is not None and found[0] != run.preset:
            preset, folder = found
            if chosen:
                raise UserError(
                    f"checkpoint {folder} was made with preset {preset}, this monitor runs preset "
                    f"{run.preset}: pass --preset {preset} to resume it"
                )
            return preset, f"checkpoint {folder}"
    return None
