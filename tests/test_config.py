import dataclasses
import subprocess
import sys

import pytest

from cotrain import cli
from cotrain import config as cfg


def test_every_preset_loads_and_validates():
    for name in cfg.preset_names():
        c = cfg.resolve(name)
        assert c.run.preset == name and c.run.model, name


def test_albert_large_v2_is_the_seed_recipe():
    run = cfg.resolve("albert-large-v2").run
    m = run.model
    assert (m["num_hidden_layers"], m["hidden_size"], m["num_attention_heads"]) == (24, 1024, 16)
    assert (m["intermediate_size"], m["embedding_size"], m["num_hidden_groups"]) == (4096, 128, 1)
    assert run.max_seq_length == 512 and run.target_batch_size == 4096
    assert (run.optimizer, run.learning_rate, run.adam_beta1, run.adam_beta2) == ("lamb", 0.00176, 0.9, 0.999)
    assert (run.adam_epsilon, run.weight_decay, run.clamp_value) == (1e-6, 0.01, 10000.0)
    assert (run.warmup_steps, run.total_steps) == (5000, 125000)


def test_albert_tiny_is_about_two_million_parameters():
    from cotrain.models import build_model

    model = build_model(cfg.resolve("albert-tiny").run, vocab_size=8000)
    n = sum(p.numel() for p in model.parameters())
    assert 1.5e6 < n < 3.5e6, n


def test_precedence_cli_over_file_over_preset(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[run]\npreset = "albert-tiny"\nlearning_rate = 0.01\ntarget_batch_size = 256\n')
    c = cfg.resolve(config_file=str(toml), overrides={"run": {"target_batch_size": 512}})
    assert c.run.preset == "albert-tiny"
    assert c.run.learning_rate == 0.01  # file beats preset
    assert c.run.target_batch_size == 512  # command line beats file
    assert c.run.max_seq_length == 128  # preset beats default
    assert c.peer.refresh_period == cfg.PeerConfig().refresh_period  # default


def test_every_problem_is_listed_at_once(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text('[run]\nlearning_rat = 1\ntarget_batch_size = "big"\n[nope]\nx = 1\n')
    with pytest.raises(cfg.ConfigError) as e:
        cfg.resolve("albert-tiny", str(toml))
    text = str(e.value)
    assert "run.learning_rat" in text and "target_batch_size" in text and "[nope]" in text


def test_semantic_validation():
    with pytest.raises(cfg.ConfigError, match="smaller than one step"):
        cfg.resolve(
            "albert-tiny",
            overrides={"run": {"target_batch_size": 4}, "peer": {"per_device_train_batch_size": 8}},
        )
    with pytest.raises(cfg.ConfigError, match="per_device_train_batch_size must be positive"):
        cfg.resolve("albert-tiny", overrides={"peer": {"per_device_train_batch_size": 0}})
    with pytest.raises(cfg.ConfigError, match="unknown preset"):
        cfg.resolve("albert-huge")


def test_seed_spellings_parse_to_the_same_fields():
    ns, c = cli.parse(
        [
            "train",
            "--experiment_prefix",
            "my-run",
            "--per_device_train_batch_size",
            "2",
            "--averaging_expiration",
            "7",
            "--client_mode",
            "--initial_peers",
            "/ip4/1.2.3.4/tcp/5/p2p/X",
            "/ip4/1.2.3.5/tcp/5/p2p/Y",
            "--preset",
            "albert-tiny",
        ]
    )
    assert c.run.run_id == "my-run" and c.peer.per_device_train_batch_size == 2
    assert c.run.matchmaking_time == 7.0 and c.peer.client_mode
    assert len(c.peer.initial_peers) == 2


def test_every_option_has_a_doc_line():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (name, action.option_strings)
    for section, cls in cfg.SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"].endswith((".", ")")), (section, f.name)


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


def test_bad_flag_is_one_line_and_nonzero(capsys):
    assert cli.main(["train", "--target-batch-size", "-3", "--preset", "albert-tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cotrain train: error:")
