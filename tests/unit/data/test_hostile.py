"""A hostile dataset host, and files cotrain reads back.

Here, in the test process alone; the rest in tests/live/test_hostile.py."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from cotrain import checkpoints as ck
from cotrain.cli import main
from cotrain.data import DataError, ExampleStream, read_manifest
from cotrain.data.fetch import download
from cotrain.data.manifest import parse_manifest
from cotrain.data.objectives import OBJECTIVES
from cotrain.data.stream import shard_order
from support.hostile import CLIMB, PAYLOAD, sha, tree

MANIFEST_CAP = 16 << 20  # cotrain.data.manifest.MAX_MANIFEST_BYTES


SHARDS_CAP = 50_000  # cotrain.data.manifest.MAX_SHARDS


def read_one(url: str, cache: Path) -> None:
    """Open a stream on ``url`` and read an example (a shard's download happens there)."""
    stream = ExampleStream(url, seed=0, cache_dir=cache)
    try:
        next(iter(stream))
    finally:
        stream.close()


# (id, rewrite(manifest, tmp_path), what the one line names)
ATTACKS: list[tuple[str, Callable[[dict, Path], None], str]] = [
    (
        "absolute tokenizer file name",
        lambda m, t: m["tokenizer"]["files"].update({str(t / "planted.json"): sha(PAYLOAD)}),
        "tokenizer.files[",
    ),
    (
        "tokenizer file name with ..",
        lambda m, t: m["tokenizer"]["files"].update({CLIMB + "planted.json": sha(PAYLOAD)}),
        "tokenizer.files[",
    ),
    (
        "tokenizer file name with a backslash",
        lambda m, t: m["tokenizer"]["files"].update({"..\\planted.json": sha(PAYLOAD)}),
        "tokenizer.files[",
    ),
    (
        "tokenizer_hash that is a path",
        lambda m, t: m.update(tokenizer_hash="../../hashdir"),
        "tokenizer_hash",
    ),
    (
        "tokenizer folder outside the dataset",
        lambda m, t: m["tokenizer"].update(path="../elsewhere"),
        "tokenizer.path",
    ),
    (
        "shard path outside the dataset",
        lambda m, t: m["shards"]["train"][0].update(path="../../victim.parquet"),
        "shards.train[0].path",
    ),
]


@pytest.mark.parametrize(("rewrite", "field"), [pytest.param(*a[1:], id=a[0]) for a in ATTACKS])
def test_a_manifest_that_names_paths_outside_the_cache_is_refused(hosted, tmp_path, rewrite, field):
    host = hosted(lambda m: rewrite(m, tmp_path))
    cache = tmp_path / "cache"
    before = tree(tmp_path, cache)
    with pytest.raises(DataError) as e:
        read_one(host.url, cache)
    message = str(e.value)
    assert "\n" not in message and "is not a valid cotrain manifest" in message and field in message, message
    assert host.requests == ["/manifest.json"]  # nothing fetched on a manifest that fails the schema
    assert tree(tmp_path, cache) == before  # nothing created or deleted outside the cache
    assert not (cache / "manifests").exists() or not any((cache / "manifests").iterdir())  # nor cached


def test_a_shard_hash_that_is_a_path_deletes_nothing(hosted, tmp_path):
    """The shard's sha256 names its file in the cache (cache/shards/SHA256.parquet), which is first removed
    when it does not verify: a hash like ../../victim would delete any *.parquet the user can write."""
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"a user's data")

    def rewrite(manifest: dict) -> None:  # the shard that a stream with seed 0 reads first
        shards = manifest["shards"]["train"]
        shards[shard_order(len(shards), 0, 0)[0]]["sha256"] = "../../victim"

    host = hosted(rewrite)
    cache = tmp_path / "cache"
    (cache / "shards").mkdir(parents=True)  # a cache used before (../.. climbs from a folder that exists)
    before = tree(tmp_path, cache)
    with pytest.raises(DataError) as e:
        read_one(host.url, cache)
    assert victim.is_file() and victim.read_bytes() == b"a user's data"
    assert re.search(r"shards\.train\[\d+\]\.sha256: must be a sha256", str(e.value)), e.value
    assert tree(tmp_path, cache) == before and host.requests == ["/manifest.json"]


def test_a_huge_manifest_is_refused_without_reading_it_whole(hosted, tmp_path):
    """Over 16 MiB (MAX_MANIFEST_BYTES) the manifest is refused (and not taken from the cache instead)."""
    host = hosted(lambda m: m["source"].update(padding="x" * (MANIFEST_CAP + 1024)))
    cache = tmp_path / "cache"
    before = tree(tmp_path, cache)
    with pytest.raises(DataError, match=r"manifest\.json is larger than 16 MiB"):
        read_one(host.url, cache)
    host.routes["/manifest.json"] = (b"x" * (MANIFEST_CAP + 1), False)  # no length announced
    with pytest.raises(DataError, match=r"manifest\.json is larger than 16 MiB"):
        read_one(host.url, cache)
    assert tree(tmp_path, cache) == before and host.requests == ["/manifest.json"] * 2
    assert not (cache / "manifests").exists() or not any((cache / "manifests").iterdir())


@pytest.mark.parametrize("announce", [True, False], ids=["announced", "unannounced"])
def test_a_shard_larger_than_recorded_is_cut_off_and_deleted(hosted, prepared, tmp_path, announce):
    """The host serves the stream's first shard with more bytes than its manifest records: the download
    stops at the recorded size (or at once, when the length is announced), leaves no .part file and is
    not tried again."""
    host = hosted(lambda m: None)
    shards = read_manifest(prepared)["shards"]["train"]
    entry = shards[shard_order(len(shards), 0, 0)[0]]  # the one a stream with seed 0 reads first
    grown = (prepared / entry["path"]).read_bytes() + os.urandom(1 << 20)
    host.routes["/" + entry["path"]] = (grown, announce)
    cache = tmp_path / "cache"
    before = tree(tmp_path, cache)
    with pytest.raises(DataError, match=rf"{entry['path']} is larger than {entry['bytes']} bytes, the most"):
        read_one(host.url, cache)
    assert host.requests.count("/" + entry["path"]) == 1, host.requests  # refused at once, not fetched again
    assert not list((cache / "shards").glob(entry["sha256"] + "*"))  # no .part left, nothing cached
    assert tree(tmp_path, cache) == before


def test_download_stops_at_max_bytes(hosted, prepared, tmp_path):
    host = hosted(lambda m: None)
    host.routes["/big"] = (b"y" * 5000, False)
    dest = tmp_path / "dl" / "big"
    with pytest.raises(DataError, match="is larger than 4096 bytes"):
        download(host.url + "big", dest, max_bytes=4096)
    assert sorted((tmp_path / "dl").iterdir()) == []
    small = download(host.url + "big", tmp_path / "dl" / "ok", max_bytes=5000, sha256=sha(b"y" * 5000))
    assert small.read_bytes() == b"y" * 5000


def test_a_tokenizer_file_over_its_cap_is_refused(hosted, prepared, tmp_path, monkeypatch):
    """Each tokenizer file is downloaded up to MAX_TOKENIZER_FILE_BYTES (64 MiB; 1000 bytes here)."""
    monkeypatch.setattr("cotrain.data.stream.MAX_TOKENIZER_FILE_BYTES", 1000)
    host = hosted(lambda m: None)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"tokenizer/tokenizer\.json is larger than 1000 bytes"):
        read_one(host.url, cache)
    assert not list(cache.rglob("tokenizer.json*"))


def test_a_model_config_from_a_url_is_capped(hosted):
    """--model-config-path may be a URL: its body is read up to 1 MiB."""
    from cotrain import config as cfg

    host = hosted(lambda m: None)
    host.routes["/config.json"] = (json.dumps({"model_type": "albert", "hidden_size": 64}).encode(), True)
    host.routes["/huge.json"] = (b" " * (1 << 20) + b"{}", False)
    c = cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": host.url + "config.json"}})
    assert c.run.model["hidden_size"] == 64
    with pytest.raises(cfg.ConfigError, match=r"huge\.json is larger than 1 MiB"):
        cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": host.url + "huge.json"}})


def mutate(manifest: dict, change: Callable[[dict], None]) -> str:
    changed = copy.deepcopy(manifest)
    change(changed)
    return json.dumps(changed)


H = "0" * 64


SCHEMA_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    ("uppercase hash", lambda m: m["shards"]["train"][0].update(sha256="A" * 64), "shards.train[0].sha256"),
    ("short hash", lambda m: m["tokenizer"]["files"].update({"tokenizer.json": "ab"}), "tokenizer.files"),
    ("NUL in a name", lambda m: m["tokenizer"]["files"].update({"a\x00b": H}), "tokenizer.files"),
    ("empty name", lambda m: m["tokenizer"]["files"].update({"": H}), "tokenizer.files"),
    ("dot-dot name", lambda m: m["tokenizer"]["files"].update({"..": H}), "tokenizer.files"),
    ("dot name", lambda m: m["tokenizer"]["files"].update({".": H}), "tokenizer.files"),
    ("no tokenizer.json", lambda m: m["tokenizer"]["files"].pop("tokenizer.json"), "tokenizer"),
    ("absolute shard", lambda m: m["shards"]["train"][0].update(path="/x.parquet"), "shards.train[0].path"),
    ("nested shard", lambda m: m["shards"]["train"][0].update(path="train/../00000.parquet"), "path"),
    (
        "shard of the other split",
        lambda m: m["shards"]["validation"].append(m["shards"]["train"][0]),
        "under",
    ),
    ("negative count", lambda m: m["shards"]["train"][0].update(num_tokens=-1), "num_tokens"),
    ("count as text", lambda m: m["num_examples"].update(train="5"), "num_examples.train"),
    ("zero-byte shard", lambda m: m["shards"]["train"][0].update(bytes=0), "shards.train[0].bytes"),
    ("no shard size", lambda m: m["shards"]["train"][0].pop("bytes"), "shards.train[0].bytes"),
    ("counts that disagree", lambda m: m["num_examples"].update(train=1), "num_examples.train differs"),
    ("two tokenizer hashes", lambda m: m.update(tokenizer_hash="1" * 64), "tokenizer_hash differs"),
    ("unknown objective", lambda m: m.update(objective="rlhf"), "objective"),
    ("unknown field", lambda m: m.update(run="rm -rf"), "run: Extra inputs"),
    (
        "too many shards",
        lambda m: m["shards"].update(train=m["shards"]["train"][:1] * (SHARDS_CAP + 1)),
        "shards.train",
    ),
    (
        "too many tokenizer files",
        lambda m: m["tokenizer"]["files"].update({f"f{i}": H for i in range(40)}),
        "tokenizer.files",
    ),
]


@pytest.mark.parametrize(("change", "field"), [pytest.param(*c[1:], id=c[0]) for c in SCHEMA_CASES])
def test_the_schema_names_the_offending_field_in_one_line(prepared, change, field):
    manifest = read_manifest(prepared)
    with pytest.raises(DataError) as e:
        parse_manifest(mutate(manifest, change), "http://127.0.0.1:1/manifest.json")
    message = str(e.value)
    assert "\n" not in message and "is not a valid cotrain manifest" in message and field in message, message


def test_the_schema_takes_what_prepare_writes_and_gives_a_dict(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert parse_manifest(json.dumps(manifest), "x") == manifest == read_manifest(prepared)
    from cotrain.data.manifest import MAX_MANIFEST_BYTES, MAX_SHARDS, Manifest

    assert set(Manifest.model_fields["objective"].annotation.__args__) == set(OBJECTIVES)
    assert (MAX_MANIFEST_BYTES, MAX_SHARDS) == (MANIFEST_CAP, SHARDS_CAP)
    for version in (1, 3, "2", None):
        with pytest.raises(DataError, match=r"has data format version .*run `cotrain prepare` again"):
            parse_manifest(mutate(manifest, lambda m, v=version: m.update(format_version=v)), "x")


def test_inside_keeps_paths_in_their_folder(tmp_path):
    from cotrain.data.fsutil import inside

    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    assert inside(root, "a", "b.txt") == (root / "a" / "b.txt").resolve()
    for parts in (("..", "x"), ("/etc/passwd",), ("a", "../../x"), (".",), ("a", "..")):
        with pytest.raises(DataError, match="points outside"):
            inside(root, *parts)
    (root / "link").symlink_to(tmp_path)  # a link out of the folder is followed, then refused
    with pytest.raises(DataError, match="points outside"):
        inside(root, "link", "x")


def test_a_local_dataset_whose_shard_links_outside_is_refused(prepared, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    outside = tmp_path / "elsewhere.parquet"
    first = data / read_manifest(data)["shards"]["train"][0]["path"]
    first.rename(outside)
    first.symlink_to(outside)
    with pytest.raises(DataError, match=r"train/00000\.parquet' points outside"):
        ExampleStream(data, seed=0)


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        (
            {"manifest.json": '{"name": "webapp"}', "index.html": "<html></html>"},
            "manifest.json has no format_version",
        ),
        ({"manifest.json": '{"format_version": 2}', "index.html": "<html></html>"}, "it holds 'index.html'"),
        ({"manifest.json": '{"format_version": 2}', "train/app.js": "x"}, "it holds 'train/app.js'"),
    ],
    ids=["unrelated manifest", "extra file", "extra file in a shard folder"],
)
def test_prepare_refuses_a_folder_that_only_has_a_manifest_json(tmp_path, capsys, files, reason):
    site = tmp_path / "site"
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    before = tree(tmp_path, tmp_path / "none")
    rc = main(["prepare", "--demo-corpus", "--preset", "albert-tiny", "--output", str(site)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("cotrain prepare: error: "), err
    assert "is not a cotrain dataset" in lines[0] and reason in lines[0], err
    assert tree(tmp_path, tmp_path / "none") == before  # nothing deleted, no temporary folder left


def fake_checkpoint(folder: Path, step: int, /, **changes: object) -> Path:
    """A checkpoint folder whose files verify (random bytes, not a model): enough for ck.verify."""
    folder.mkdir(parents=True)
    files = {}
    for name in (ck.MODEL, ck.OPTIMIZER):
        data = os.urandom(256)
        (folder / name).write_bytes(data)
        files[name] = sha(data)
    meta = {"format": ck.FORMAT, "step": step, "source": "test", "created": "", "run_id": "r", "config": {},
            "tokenizer_hash": H, "optimizer": {"param_groups": [], "scalars": {}}, "scheduler": None,
            "inner": None, "files": files}  # fmt: skip
    meta.update(changes)
    meta = {k: v for k, v in meta.items() if v != "drop"}
    (folder / ck.META).write_text(json.dumps(meta))
    return folder


BAD_META: list[tuple[str, dict, str]] = [
    ("files as a list", {"files": ["model.safetensors"]}, "files"),
    ("step as text", {"step": "3"}, "step"),
    ("negative step", {"step": -1}, "step"),
    ("no optimizer", {"optimizer": "drop"}, "optimizer"),
    ("no tokenizer hash", {"tokenizer_hash": "drop"}, "tokenizer_hash"),
    ("config not a table", {"config": [1, 2]}, "config"),
    ("a file outside", {"files": {"../outside.bin": sha(b"secret")}}, "files"),
]


@pytest.mark.parametrize(("changes", "field"), [pytest.param(*c[1:], id=c[0]) for c in BAD_META])
def test_a_malformed_checkpoint_json_is_skipped_in_one_line(tmp_path, caplog, changes, field):
    (tmp_path / "outside.bin").write_bytes(b"secret")
    root = tmp_path / "checkpoints"
    good = fake_checkpoint(ck.step_dir(root, 1), 1)
    bad = fake_checkpoint(ck.step_dir(root, 2), 2, **changes)
    with pytest.raises(ck.CheckpointError) as e:
        ck.verify(bad)
    message = str(e.value)
    assert "\n" not in message and f"{ck.META} is corrupted (" in message and field in message, message
    with caplog.at_level(logging.WARNING, logger="cotrain.checkpoints"):
        found = ck.latest_good(root)
    assert found is not None and found[0] == good and found[1]["step"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "cotrain.checkpoints"]
    assert len(warnings) == 1 and "Skipping a bad checkpoint" in warnings[0] and "\n" not in warnings[0]


def test_a_checkpoint_json_of_the_right_shape_reads_as_before(tmp_path):
    meta = ck.verify(fake_checkpoint(tmp_path / "step-000004", 4))
    assert meta["step"] == 4 and meta["inner"] is None
    assert meta["optimizer"] == {"param_groups": [], "scalars": {}} and meta["files"].keys() == {
        ck.MODEL,
        ck.OPTIMIZER,
    }
