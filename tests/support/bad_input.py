"""Helpers the test_bad_input tests share across suites."""

from __future__ import annotations

from conftest import LOCALHOST  # noqa: E402

DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t"


CK = "{ws}/checkpoints/step-000003"


TRUNCATED = "{ws}/truncated/step-000005"


TRAIN = ["train", "--preset", "albert-tiny", "--host-maddrs", LOCALHOST, "--output-dir", "{ws}/out"]


STATUS = ["status", "--host-maddrs", LOCALHOST]


# (what, command line, what the one line says, how it runs: "call" in this process or "process")
CASES: list[tuple[str, list[str], str, str]] = [
    ("unknown preset", ["config", "show", "albert-giant"], "unknown preset 'albert-giant'", "call"),
    ("unknown preset (train)", ["train", "--preset", "nope"], "unknown preset 'nope'", "call"),
    ("zero micro-batch", [*TRAIN, "--per-device-train-batch-size", "0"], "positive", "call"),
    ("negative micro-batch", [*TRAIN, "--per-device-train-batch-size", "-4"], "positive", "call"),
    ("zero target batch", [*TRAIN, "--target-batch-size", "0"], "target_batch_size must be positive", "call"),
    (
        "target smaller than a micro-batch",
        [*TRAIN, "--target-batch-size", "4", "--per-device-train-batch-size", "8"],
        "is smaller than one step of this peer",
        "call",
    ),
    (
        "batch size lead at the target",
        [*TRAIN, "--target-batch-size", "64", "--batch-size-lead", "200"],
        "batch_size_lead (200) must be below target_batch_size (64)",
        "call",
    ),
    ("not a number", [*TRAIN, "--learning-rate", "fast"], "invalid float value: 'fast'", "call"),
    (
        "NaN learning rate",
        [*TRAIN, "--learning-rate", "nan"],
        "learning_rate must be a finite number",
        "call",
    ),
    ("negative max steps", [*TRAIN, "--max-steps", "-1"], "must not be negative", "call"),
    (
        "client and public",
        [*TRAIN, "--client-mode", "--public"],
        "--client-mode and --public contradict each other",
        "call",
    ),
    ("run id with a dot", [*TRAIN, "--run-id", "my.run"], "run_id 'my.run' must be non-empty", "call"),
    ("unknown flag", [*TRAIN, "--frobnicate", "3"], "unrecognized arguments: --frobnicate", "call"),
    ("unknown command", ["fly"], "invalid choice: 'fly'", "call"),
    ("missing config file", [*TRAIN, "--config", "{ws}/none.toml"], "none.toml does not exist", "call"),
    ("invalid TOML", [*TRAIN, "--config", "{ws}/broken.toml"], "is not valid TOML", "call"),
    (
        "unknown TOML key",
        [*TRAIN, "--config", "{ws}/unknown_key.toml"],
        "unknown key run.learning_rat",
        "call",
    ),
    ("unknown TOML table", [*TRAIN, "--config", "{ws}/bad_table.toml"], "unknown section [trainer]", "call"),
    (
        "bad TOML value type",
        [*TRAIN, "--config", "{ws}/bad_type.toml"],
        "run.learning_rate: expected float, got str 'fast'",
        "call",
    ),
    (
        "model config with a model_type of the wrong type",
        [*TRAIN, "--model-config-path", "{ws}/model_type.json"],
        "model_type must be a string, got an integer",
        "call",
    ),
    (
        "model config with values of the wrong type",
        [*TRAIN, "--model-config-path", "{ws}/model_types.json"],
        "hidden_size must be an integer (as in the preset), got a string 'wide'",
        "call",
    ),
    (
        "model config nested too deeply",
        [*TRAIN, "--model-config-path", "{ws}/deep.json"],
        "cannot read a JSON model config (nested too deeply)",
        "call",
    ),
    ("malformed multiaddr", [*STATUS, "--initial-peers", "/ip4/nonsense"], "malformed initial peer", "call"),
    ("old-style IP:PORT peer", [*STATUS, "--initial-peers", "10.0.0.1:1337"], "old-style IP:PORT", "call"),
    ("missing dataset", [*TRAIN, "--dataset-path", "{ws}/no-data"], "no prepared dataset at", "call"),
    (
        "export of a truncated checkpoint",
        ["export", TRUNCATED, "{ws}/exported"],
        "model.safetensors is truncated or corrupted",
        "call",
    ),
    (
        "read-only output folder",
        ["monitor", "--host-maddrs", LOCALHOST, "--output-dir", "{ro}/monitor"],
        "cannot write to the output folder",
        "call",
    ),
    (
        "dashboard port out of range",
        ["monitor", "--dashboard-port", "70000"],
        "dashboard_port must be",
        "call",
    ),
    (
        "export of a missing checkpoint",
        ["export", "{ws}/none", "{ws}/exported"],
        "has no checkpoint.json",
        "call",
    ),
    (
        "export of a corrupted checkpoint",
        ["export", CK, "{ws}/exported"],
        "checkpoint.json is corrupted",
        "call",
    ),
    (
        "prepare of an empty corpus",
        ["prepare", "--text-files", "{ws}/empty.txt", "--output", "{ws}/prepared"],
        "no text in",
        "call",
    ),
    (
        "prepare of a missing file",
        ["prepare", "--text-files", "{ws}/none.txt", "--output", "{ws}/prepared"],
        "text file not found",
        "call",
    ),
    (
        "prepare of no corpus",
        ["prepare", "--output", "{ws}/prepared"],
        "no corpus: pass --text-files",
        "call",
    ),
    (
        "prepare into a read-only folder",
        ["prepare", "--demo-corpus", "--preset", "albert-tiny", "--output", "{ro}/prepared"],
        "cannot write to the folder of --output",
        "call",
    ),
    ("demo with no peers", ["demo", "--peers", "0"], "demo peers and steps must be at least 2", "call"),
    ("demo with a lone peer", ["demo", "--peers", "1"], "demo peers and steps must be at least 2", "call"),
    ("demo of one step", ["demo", "--steps", "1"], "demo peers and steps must be at least 2", "call"),
    ("a node under sync", [*TRAIN, "--nproc-per-node", "2"], "trains with --strategy diloco", "call"),
    (
        "a node with LAMB",
        [*TRAIN, "--strategy", "diloco", "--nproc-per-node", "2"],
        "'lamb' cannot do",
        "call",
    ),
    ("no dataset given", [*TRAIN], "give one of --dataset-path", "process"),
    (
        "GPUs that do not exist",
        [*TRAIN, "--dataset-path", "{data}", "--devices", "cuda:0,cuda:63"],
        "does not exist here",
        "process",
    ),
    (
        "a model too small to shard",
        [*TRAIN, "--dataset-path", "{data}", "--strategy", "diloco", "--optimizer", "adamw"]
        + ["--devices", "cpu", "--nproc-per-node", "4096"],
        "too small to shard over 4096 ranks",
        "process",
    ),
    ("peer without /p2p/", [*TRAIN, "--initial-peers", "/ip4/10.0.0.1/tcp/5"], "lacks its /p2p/", "process"),
    (
        "resume from a corrupted checkpoint",
        [*TRAIN, "--resume-from", CK],
        "checkpoint.json is corrupted",
        "process",
    ),
    (
        "unreachable initial peer",
        [*TRAIN, "--initial-peers", DEAD_PEER],
        "no initial peer could be reached",
        "process",
    ),
    (
        "port in use",
        [
            "train",
            "--preset",
            "albert-tiny",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/{port}",
            "--dataset-path",
            "{data}",
            "--output-dir",
            "{ws}/out",
        ],
        "address already in use",
        "process",
    ),
    (
        "corrupted dataset shard",
        [*TRAIN, "--dataset-path", "{corrupt}", "--target-batch-size", "16", "--max-steps", "1"],
        "is corrupt",
        "process",
    ),
]
