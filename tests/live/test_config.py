import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cotrain import cli
from cotrain import config as cfg


def test_config_show_prints_the_resolved_preset():
    out = subprocess.run(
        [sys.executable, "-m", "cotrain", "config", "show", "albert-tiny"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    import tomllib

    data = tomllib.loads(out)
    assert data["run"]["preset"] == "albert-tiny" and data["run"]["max_seq_length"] == 128


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "cotrain", "--help"], capture_output=True, text=True).stdout
    for sub in ("prepare", "train", "monitor", "demo", "config"):
        assert sub in out


def _show(*args: str) -> dict:
    import tomllib

    out = subprocess.run(
        [sys.executable, "-m", "cotrain", "config", "show", *args], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return tomllib.loads(out.stdout)


def test_the_command_line_preset_wins_and_brings_its_own_model(tmp_path):
    """`--preset` with a file naming another family's preset: one family throughout (preset, family,
    objective, model table), the file's other settings on top."""
    for text in ('preset = "gpt2-tiny"\n[run]\nlearning_rate = 0.003\n', '[run]\npreset = "gpt2-tiny"\n'):
        toml = tmp_path / "c.toml"
        toml.write_text(text)
        shown = _show("albert-tiny", "--config", str(toml))["run"]
        albert = cfg.resolve("albert-tiny").run
        assert (shown["preset"], shown["model_family"], shown["objective"]) == (
            "albert-tiny",
            "albert",
            "sop+mlm",
        )
        assert shown["model"] == albert.model
        _, c = cli.parse(["train", "--preset", "albert-tiny", "--config", str(toml)])
        assert (c.run.preset, c.run.model_family, c.run.model) == ("albert-tiny", "albert", albert.model)
        if "learning_rate" in text:
            assert shown["learning_rate"] == c.run.learning_rate == 0.003


def test_a_trainers_supervisor_checks_its_dataset_without_the_heavy_libraries(tmp_path):
    """The supervisor stays for the whole run: it must not hold torch, transformers or pyarrow (measured: 52
    MB USS more when it did, through the dataset module). Checked in a fresh interpreter."""
    data = tmp_path / "data"
    data.mkdir()
    h = "0" * 64  # a manifest of the right shape (the supervisor reads nothing else of the dataset)
    counts = {"train": 1, "validation": 0}
    manifest = {
        "format_version": 2, "objective": "sop+mlm", "max_length": 128, "seed": 0, "valid_fraction": 0.0,
        "source": {}, "config": {}, "columns": ["input_ids"], "num_documents": counts, "num_examples": counts,
        "num_tokens": counts, "mean_tokens_per_example": 1.0, "tokenizer_hash": h, "vocab_size": 100,
        "tokenizer": {"path": "tokenizer", "type": "unigram", "hash": h, "vocab_size": 100,
                      "files": {"tokenizer.json": h}},
        "shards": {"train": [{"path": "train/00000.parquet", "num_examples": 1, "num_tokens": 1, "bytes": 1,
                              "sha256": h}], "validation": []},
    }  # fmt: skip
    (data / "manifest.json").write_text(json.dumps(manifest))
    code = (
        "import sys; from cotrain import cli; "
        f"ns, c = cli.parse(['train', '--preset', 'albert-tiny', '--dataset-path', {str(data)!r}, "
        f"'--output-dir', {str(tmp_path / 'out')!r}]); cli.check_local_paths('train', c); "
        "import cotrain.host.procs; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'hivemind', 'transformers', 'pyarrow', 'datasets', 'tokenizers', 'numpy', 'pandas'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def test_help_groups_the_options_by_component():
    out = subprocess.run(
        [sys.executable, "-m", "cotrain", "train", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for title in ("run", "network", "data", "trainer", "averaging", "general"):
        assert f"\n{title} options (" in out, title
    averaging = out.split("\naveraging options (")[1].split("\n\n")[1]
    assert "--matchmaking-time" in averaging and "--batch-size-lead" in averaging


DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("doc", ["models.md", "options.md", "diloco.md"])
def test_the_toml_examples_in_the_docs_resolve(doc, tmp_path, monkeypatch):
    # options.md's example of a part's parameters names the toy parts: registered for this test only
    from cotrain import registry

    kept = {name: dict(getattr(registry, name)) for name in ("STRATEGIES", "AGGREGATIONS", "CODECS")}
    kept["AGGREGATION_PARAMETERS"] = dict(registry.AGGREGATION_PARAMETERS)
    monkeypatch.delitem(sys.modules, "toy_parts", raising=False)
    importlib.import_module("toy_parts")
    monkeypatch.delitem(sys.modules, "toy_parts")
    try:
        _resolve_the_docs_toml(doc, tmp_path)
    finally:
        for name, entries in kept.items():
            getattr(registry, name).clear()
            getattr(registry, name).update(entries)


def _resolve_the_docs_toml(doc, tmp_path):
    blocks = re.findall(r"```toml\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)
    assert blocks, f"docs/{doc} has no TOML example"
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.toml"
        path.write_text(block)
        c = cfg.resolve(config_file=str(path))
        top = re.search(r'^preset = "([\w-]+)"', block, flags=re.M)
        if top:
            assert c.run.preset == top.group(1) and c.run.model_family == top.group(1).split("-")[0]
            assert _show(top.group(1), "--config", str(path))["run"]["preset"] == top.group(1)
