"""Helpers the test_roles_errors tests share across suites."""

from __future__ import annotations


def _dataset_for(tmp_path, preset: str):
    """A prepared-looking dataset folder whose manifest names ``preset`` (the monitor's supervisor reads only
    the manifest before it starts anything)."""
    import json

    folder = tmp_path / f"data-{preset}"
    folder.mkdir()
    counts = {"train": 0, "validation": 0}
    digest = "0" * 64
    manifest = {
        "format_version": 2, "objective": "sop+mlm", "max_length": 128, "seed": 0, "valid_fraction": 0.02,
        "source": {"kind": "demo"}, "config": {"preset": preset}, "columns": ["input_ids"],
        "num_documents": counts, "num_examples": counts, "num_tokens": counts, "mean_tokens_per_example": 0.0,
        "tokenizer": {
            "path": "tokenizer", "type": "unigram", "hash": digest, "vocab_size": 8,
            "files": {"tokenizer.json": digest},
        },
        "tokenizer_hash": digest, "vocab_size": 8, "shards": {"train": [], "validation": []},
    }  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder
