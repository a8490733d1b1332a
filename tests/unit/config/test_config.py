import dataclasses
import json

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
    assert c.peer.matchmaking_time == 7.0 and c.peer.client_mode
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


def test_bad_flag_is_one_line_and_nonzero(capsys):
    assert cli.main(["train", "--target-batch-size", "-3", "--preset", "albert-tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cotrain train: error:")


def test_a_config_file_names_its_preset_at_the_top(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('preset = "gpt2-tiny"\n\n[run]\nlearning_rate = 0.001\n')
    c = cfg.resolve(config_file=str(toml))
    assert (c.run.preset, c.run.model_family, c.run.learning_rate) == ("gpt2-tiny", "gpt2", 0.001)
    assert c.run.model == cfg.resolve("gpt2-tiny").run.model
    _, c = cli.parse(["train", "--config", str(toml)])
    assert c.run.preset == "gpt2-tiny" and "n_layer" in c.run.model
    toml.write_text('preset = "gpt2-tiny"\n[run]\npreset = "bert-tiny"\n')
    with pytest.raises(cfg.ConfigError, match="names two presets"):
        cfg.resolve(config_file=str(toml))
    toml.write_text('run_id = "x"\n')
    with pytest.raises(cfg.ConfigError, match="unknown top-level key 'run_id'"):
        cfg.resolve(config_file=str(toml))


def test_averaging_settings_are_per_peer_and_outside_the_config_hash(tmp_path):
    run_fields = {f.name for f in dataclasses.fields(cfg.RunConfig)}
    per_peer = {"matchmaking_time", "averaging_timeout", "grad_compression", "target_group_size"}
    per_peer |= {"batch_size_lead", "min_refresh_period", "max_refresh_period", "default_refresh_period"}
    assert not per_peer & run_fields
    assert per_peer <= {f.name for f in dataclasses.fields(cfg.AveragingConfig)}
    base = cfg.resolve("albert-tiny")
    tuned = cfg.resolve(
        "albert-tiny",
        overrides={"peer": {"matchmaking_time": 10.0, "averaging_timeout": 30.0, "grad_compression": "none"}},
    )
    assert cfg.config_hash(base.run) == cfg.config_hash(tuned.run)
    assert (tuned.peer.matchmaking_time, tuned.peer.grad_compression) == (10.0, "none")
    # an older file (or preset) that still has them in [run]: read as this peer's settings
    old = tmp_path / "old.toml"
    old.write_text('[run]\nmatchmaking_time = 9\naveraging_timeout = 40.0\ngrad_compression = "none"\n')
    c = cfg.resolve("albert-tiny", str(old))
    assert (c.peer.matchmaking_time, c.peer.averaging_timeout, c.peer.grad_compression) == (9.0, 40.0, "none")
    assert cfg.config_hash(c.run) == cfg.config_hash(base.run)
    assert set(c.run_given) == {"preset", *cfg.load_preset("albert-tiny")["run"]}  # [run] keys left: none
    # a checkpoint's run table written before the move still loads
    assert cfg.RunConfig.from_dict({**dataclasses.asdict(base.run), "matchmaking_time": 2.0}) == base.run


def test_run_given_names_the_run_settings_the_user_chose(tmp_path):
    peers = ["--initial-peers", "/ip4/127.0.0.1/tcp/5/p2p/X"]
    assert cli.parse(["train", "--run-id", "r", *peers])[1].run_given == []
    given = cli.parse(["train", "--run-id", "r", "--learning-rate", "0.1", "--averaging-expiration", "9"])[1]
    assert given.run_given == ["learning_rate"]
    with_preset = cli.parse(["train", "--run-id", "r", "--preset", "albert-tiny"])[1].run_given
    assert "preset" in with_preset and "target_batch_size" in with_preset and "run_id" not in with_preset
    toml = tmp_path / "c.toml"
    toml.write_text('[run]\nrun_id = "r"\nweight_decay = 0.2\n[peer]\nseed = 3\n')
    assert cli.parse(["train", "--config", str(toml)])[1].run_given == ["weight_decay"]


def test_the_resolved_config_survives_its_file_round_trips(tmp_path):
    _, c = cli.parse(
        ["train", "--preset", "gpt2-tiny", "--run-id", "trip", "--per-device-train-batch-size", "auto"]
        + [
            "--weight-decay",
            "0.3",
            "--matchmaking-time",
            "3",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/5/p2p/X",
        ]
    )
    (tmp_path / "resolved.json").write_text(cfg.resolved_json(c))
    back = cfg.load_resolved(tmp_path / "resolved.json")
    assert back == c and back.run_given == c.run_given and "weight_decay" in back.run_given
    # OUTPUT_DIR/config.toml: what --config reads back to the same run and peer settings
    again = cfg.resolve(config_file=str(cfg.write_toml(c, tmp_path / "config.toml")))
    assert (again.run, again.peer) == (c.run, c.peer)
    assert 'per_device_train_batch_size = "auto"' in (tmp_path / "config.toml").read_text()
    assert not list(tmp_path.glob(".*"))  # no temporary file left
    (tmp_path / "bad.json").write_text('{"run": {"target_batch_size": -1}}')
    with pytest.raises(cfg.ConfigError, match="target_batch_size must be positive"):
        cfg.load_resolved(tmp_path / "bad.json")


def test_a_supervised_worker_gets_the_resolved_config_on_its_standard_input(monkeypatch):
    import io

    from cotrain.host import procs

    _, c = cli.parse(["train", "--preset", "albert-tiny", "--run-id", "handed", "--weight-decay", "0.25"])
    seen = {}

    def fake_worker(command: list[str], config) -> int:
        seen["command"] = command
        monkeypatch.setattr("sys.stdin", io.StringIO(cfg.resolved_json(config)))
        seen["config"] = cfg.load_resolved("-")  # what the worker reads
        return 7

    monkeypatch.setattr(procs, "_run_worker", fake_worker)
    assert procs.supervise("train", c) == 7
    assert seen["command"][1:] == ["-m", "cotrain._worker", "train", "--resolved-config", "-"]
    assert seen["config"] == c
    monkeypatch.setattr("sys.stdin", io.StringIO("[1, 2]"))
    with pytest.raises(cfg.ConfigError, match="resolved config on standard input is not a JSON object"):
        cfg.load_resolved("-")


def test_the_worker_refuses_a_bad_resolved_config_in_one_line(tmp_path, capsys):
    from cotrain import _worker

    (tmp_path / "c.json").write_text("not json")
    assert _worker.main(["train", "--resolved-config", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not readable JSON" in err[0], err


def test_every_component_checks_its_own_fields_and_all_problems_come_at_once():
    assert issubclass(cfg.PeerConfig, cfg.PEER_COMPONENTS)
    for component in cfg.PEER_COMPONENTS:
        assert component().problems() == [], component
    peer = cfg.PeerConfig(startup_timeout=0, matchmaking_time=-1, logging_steps=0, refresh_period=0)
    text = "; ".join(peer.problems())
    for name in ("startup_timeout", "matchmaking_time", "logging_steps", "refresh_period"):
        assert name in text, (name, text)
    with pytest.raises(cfg.ConfigError) as e:
        cli.parse(["train", "--startup-timeout", "0", "--averaging-timeout", "0", "--learning-rate", "0"])
    assert all(n in str(e.value) for n in ("startup_timeout", "averaging_timeout", "learning_rate"))


def test_the_diloco_demo_takes_short_rounds_unless_local_steps_is_given(tmp_path):
    """`cotrain demo --strategy diloco` hands its peers --local-steps 5 (the demo's) instead of 50, unless the
    user chose local_steps (command line or --config file); sync runs and other roles keep the default."""
    from cotrain.cli import parse
    from cotrain.config.demo import DEMO_LOCAL_STEPS
    from cotrain.demo import demo_run_settings

    def demo_local_steps(*argv: str) -> tuple[str, int]:
        _, config = parse(["demo", *argv])
        run = demo_run_settings(config).run
        return run.strategy, run.local_steps

    assert DEMO_LOCAL_STEPS == 5 and cfg.RunConfig().local_steps == 50
    assert demo_local_steps("--strategy", "diloco") == ("diloco", 5)
    assert demo_local_steps("--strategy", "diloco", "--local-steps", "50") == ("diloco", 50)
    assert demo_local_steps("--strategy", "diloco", "--local_steps", "7") == ("diloco", 7)
    assert demo_local_steps() == ("sync", 50)
    toml = tmp_path / "d.toml"
    toml.write_text('[run]\nstrategy = "diloco"\nlocal_steps = 12\n')
    assert demo_local_steps("--config", str(toml)) == ("diloco", 12)
    _, config = parse(["train", "--strategy", "diloco"])
    assert config.run.local_steps == 50


def test_demo_help_lists_the_strategy_flags_and_the_demo_default(capsys):
    from cotrain.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--strategy", "--local-steps", "--outer-lr", "--outer-momentum", "--outer-overlap"):
        assert flag in text, flag
    assert "--grad-compression" in text and "8bit" in text
    assert "With --strategy diloco and no --local-steps, the demo's rounds are --local-steps 5" in text


def test_a_model_config_of_the_wrong_types_is_one_line(tmp_path):
    """--model-config-path values of the wrong JSON type: refused when the config resolves where the preset
    sets that key, else when the model is built (transformers checks each field), in one line either way."""
    from cotrain.errors import UserError
    from cotrain.models import build_model

    def resolved(content: object) -> cfg.Config:
        (tmp_path / "config.json").write_text(json.dumps(content))
        return cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": str(tmp_path)}})

    for content, problem in [
        ({"model_type": 5}, "model_type must be a string, got an integer"),
        ({"model_type": ["albert"]}, "model_type must be a string, got a list"),
        ({"hidden_size": "wide"}, "hidden_size must be an integer (as in the preset), got a string 'wide'"),
        ({"hidden_size": 32.5}, "hidden_size must be an integer (as in the preset), got a number 32.5"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be an integer (as in the preset), got true"),
        ({"hidden_act": {"name": "gelu"}}, "hidden_act must be a string (as in the preset), got an object"),
        ({"hidden_dropout_prob": None}, "hidden_dropout_prob must be a number (as in the preset), got null"),
    ]:
        with pytest.raises(cfg.ConfigError) as e:
            resolved(content)
        assert problem in str(e.value) and "\n" not in str(e.value), (content, str(e.value))
    assert (
        resolved({"hidden_dropout_prob": 0}).run.model["hidden_dropout_prob"] == 0
    )  # an integer is a number
    # a key the preset does not set: transformers' own check, as one line when the model is built
    run = resolved({"classifier_dropout_prob": "high"}).run
    with pytest.raises(UserError) as e:
        build_model(run, vocab_size=300)
    message = str(e.value)
    assert message.startswith("[run.model] does not fit AlbertConfig: ") and "\n" not in message, message
    assert "'classifier_dropout_prob'" in message and "'high'" in message, message
    run = resolved({"intermediate_size": -5}).run  # the right type, a value the model cannot take
    with pytest.raises(UserError, match=r"cannot build the AlbertForPreTraining from \[run.model\]") as e:
        build_model(run, vocab_size=300)
    assert "\n" not in str(e.value)
