"""Every option of the original trainer and monitor.

Here, in the test process alone; the rest in tests/live/test_options.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cotrain import cli
from cotrain import config as cfg
from cotrain.errors import UserError
from support.seeds import seed_commands


def test_the_seed_documents_hold_the_expected_command_lines():
    commands = seed_commands()
    roles = [role for role, _, _ in commands]
    assert roles.count("train") >= 6 and roles.count("monitor") >= 4, commands
    flags = {a.split("=")[0] for _, args, _ in commands for a in args if a.startswith("--")}
    for flag in (
        "--listen_on",
        "--dht_listen_on",
        "--experiment_prefix",
        "--averaging_expiration",
        "--client_mode",
    ):
        assert flag in flags, flag


@pytest.mark.parametrize("role,args,line", seed_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_seed_command_line_parses(role, args, line):
    ns, config = cli.parse([role, *args])
    assert ns.command == role
    given = dict(zip(args, [*args[1:], ""], strict=False))
    if "--experiment_prefix" in given:
        assert config.run.run_id == given["--experiment_prefix"], line
    if "--averaging_expiration" in given:
        assert config.peer.matchmaking_time == float(given["--averaging_expiration"]), line
    if "--per_device_train_batch_size" in given:
        expected = given["--per_device_train_batch_size"]
        assert config.peer.per_device_train_batch_size == (cfg.AUTO if expected == "auto" else int(expected))
    if "--client_mode" in given:
        assert config.peer.client_mode
    if "--logging_steps" in given:
        assert config.peer.logging_steps == int(given["--logging_steps"]) and config.peer.logging_first_step
    for listen in ("--listen_on", "--dht_listen_on"):
        if listen in given:
            from cotrain.net.dht import parse_maddrs

            assert parse_maddrs(config.peer.host_maddrs, "listen")[0].startswith("/ip6/::/tcp/"), line


def _value_for(section: str, f: dataclasses.Field):
    """A valid value different from the default, and how to write it on the command line."""
    special = {
        "run_id": "my-run",
        "preset": "albert-tiny",
        "optimizer": "adamw",
        "lr_scheduler": "cosine",
        "grad_compression": "none",
        "warmup_steps": 10,
        "max_seq_length": 256,
        "mlm_probability": 0.2,
        "init_from": "/models/albert",
        "model_config_path": "",  # reads a file: tested below
        "devices": "cpu",
        "nproc_per_node": 1,  # more ranks need --strategy diloco: tests/live/test_node.py
        "per_device_train_batch_size": 16,
        "fp16": None,  # exclusive with bf16: tested below
        "delay_optimizer_step": None,
        "delay_grad_averaging": None,
        "offload_optimizer": None,  # --no-offload-optimizer tested below
        "dashboard_host": "127.0.0.2",
        "dashboard_port": 9999,
        "performance_ema_alpha": 0.5,
        "expected_drift_rate": 0.5,
        "valid_fraction": 0.1,
        "objective": "mlm",
        "tokenizer_type": "wordpiece",
        "strategy": "diloco",
        "outer_momentum": 0.5,  # must stay below 1
        "aggregation": "centered-clip",
        "clip_tau": "0.25",
        "outer_compression": None,  # needs --strategy diloco: tests/live/test_sparse.py
        "topk_density": 0.03,
        "topk_bits": 4,
        "topk_feedback_decay": 0.5,
        # a part's parameters, checked against what it declares: tests/live/test_parts.py
        "aggregation_options": None,
        "outer_compression_options": None,
        "grad_compression_options": None,
    }
    if f.name in special:
        return special[f.name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    t = cfg.field_type(f)
    if t is bool:
        return not default
    if t is int:
        return default + 7
    if t is float:
        return default + 1.5
    if t is list:
        return ["/ip4/127.0.0.1/tcp/4000"]
    return "/tmp/somewhere"


@pytest.mark.parametrize("role", ["train", "monitor", "eval", "prepare", "demo", "status"])
def test_every_option_reaches_its_field(role):
    """Each option of a role, given on the command line (in its kebab-case and its original spelling),
    lands in the field it names."""
    checked = 0
    for section, f in cfg.fields_for(role):
        value = _value_for(section, f)
        if value in (None, ""):
            continue
        for flag in {cfg.cli_flags(f)[0], *cfg.seed_flags(f)}:
            if cfg.field_type(f) is bool:
                argv = [flag] if value else ["--no-" + cfg.cli_flags(f)[0][2:]]
            elif isinstance(value, list):
                argv = [flag, *value]
            else:
                argv = [flag, str(value)]
            _, config = cli.parse(
                [role, "--preset", "albert-tiny", *argv] if f.name != "preset" else [role, *argv]
            )
            got = getattr(getattr(config, section), f.name)
            assert got == value, (role, flag, got, value)
            checked += 1
    assert checked >= 3


def test_switches_that_are_on_by_default_have_a_no_form():
    _, c = cli.parse(["train", "--no-offload-optimizer", "--no-delay-state-averaging", "--no-use-relay"])
    assert (c.peer.offload_optimizer, c.peer.delay_state_averaging, c.peer.use_relay) == (False, False, False)
    _, c = cli.parse(["monitor", "--store_checkpoints"])
    assert c.peer.store_checkpoints
    _, c = cli.parse(["monitor", "--no-store-checkpoints"])
    assert not c.peer.store_checkpoints
    _, c = cli.parse(["train", "--delay-grad-averaging", "--use-auto-relay", "--fp16"])
    assert c.peer.delay_grad_averaging and c.peer.use_auto_relay and c.peer.fp16


def test_inconsistent_options_are_refused_with_every_problem():
    with pytest.raises(cfg.ConfigError) as e:
        cli.parse(
            [
                "train",
                "--fp16",
                "--bf16",
                "--delay-optimizer-step",
                "--no-offload-optimizer",
                "--logging-steps",
                "0",
            ]
        )
    text = str(e.value)
    assert "--fp16 or --bf16" in text and "offload_optimizer" in text and "logging_steps" in text


def test_the_original_listen_forms_become_multiaddrs():
    from cotrain.net.dht import parse_maddrs

    assert parse_maddrs(["[::]:1337"], "listen") == ["/ip6/::/tcp/1337"]
    assert parse_maddrs(["[::]:*"], "listen") == ["/ip6/::/tcp/0"]
    assert parse_maddrs(["0.0.0.0:*"], "listen") == ["/ip4/0.0.0.0/tcp/0"]
    assert parse_maddrs(["/ip4/127.0.0.1/tcp/0"], "listen") == ["/ip4/127.0.0.1/tcp/0"]
    with pytest.raises(UserError, match=r"/ip4/18\.224\.82\.24/tcp/31337/p2p/PEER_ID"):
        parse_maddrs(["18.224.82.24:31337"], "initial peer")


def test_model_config_path_overrides_the_preset_architecture(tmp_path):
    from cotrain.models import build_model

    hf_config = {
        "architectures": ["AlbertForMaskedLM"],
        "model_type": "albert",
        "hidden_size": 64,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "embedding_size": 32,
        "vocab_size": 30000,
        "transformers_version": "4.0.0",
    }
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    plain = cfg.resolve("albert-tiny")
    for given in (tmp_path / "config.json", tmp_path):  # a JSON file or a Hugging Face model folder
        c = cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": str(given)}})
        assert c.run.model["hidden_size"] == 64 and c.run.model["num_hidden_layers"] == 2
        assert "vocab_size" not in c.run.model and "architectures" not in c.run.model
        assert c.run.model["max_position_embeddings"] == plain.run.model["max_position_embeddings"]  # kept
        assert cfg.config_hash(c.run) != cfg.config_hash(plain.run)  # peers must agree on the architecture
    model = build_model(c.run, vocab_size=500)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == 500  # from the tokenizer, not the file
    _, c = cli.parse(["train", "--preset", "albert-tiny", "--config_path", str(tmp_path)])
    assert c.run.model["hidden_size"] == 64


def test_a_bad_model_config_path_is_one_clear_problem(tmp_path):
    (tmp_path / "gpt.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(cfg.ConfigError, match="'gpt2' config, but the preset trains 'albert'"):
        cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": str(tmp_path / "gpt.json")}})
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(cfg.ConfigError, match="cannot read a JSON model config"):
        cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": str(tmp_path / "broken.json")}})
    with pytest.raises(cfg.ConfigError, match="cannot read"):
        cfg.resolve("albert-tiny", overrides={"peer": {"model_config_path": str(tmp_path / "missing.json")}})


def test_auto_micro_batch_parses_from_the_command_line_and_toml(tmp_path):
    _, c = cli.parse(["train", "--per-device-train-batch-size", "auto"])
    assert c.peer.per_device_train_batch_size == cfg.AUTO
    toml = tmp_path / "c.toml"
    toml.write_text('[peer]\nper_device_train_batch_size = "auto"\n')
    assert cfg.resolve("albert-tiny", str(toml)).peer.per_device_train_batch_size == cfg.AUTO
    for bad in ("big", "0", "-2"):
        with pytest.raises((SystemExit, UserError)):
            cli.parse(["train", "--per-device-train-batch-size", bad])


def test_largest_fitting_micro_batch_under_a_memory_budget():
    from cotrain.host.hardware import largest_fitting

    def budget(total_mb: float, per_sample_mb: float, fixed_mb: float):
        tried = []

        def fits(size: int) -> bool:
            tried.append(size)
            return fixed_mb + size * per_sample_mb <= total_mb

        return fits, tried

    fits, tried = budget(16000, 700, 3000)  # room for 18 samples
    assert largest_fitting(fits, 4096) == 16 and tried == [1, 2, 4, 8, 16, 32]
    fits, tried = budget(16000, 700, 3000)
    assert largest_fitting(fits, 12) == 12 and tried == [1, 2, 4, 8, 12]  # capped by the samples wanted
    fits, _ = budget(1000, 700, 3000)
    assert largest_fitting(fits, 64) == 0  # not even one sample


def test_auto_on_a_cpu_takes_the_documented_default_and_accumulates_the_rest():
    from cotrain.host.hardware import CPU_MICRO_BATCH, accumulation_for, auto_micro_batch

    cpu = torch.device("cpu")
    assert CPU_MICRO_BATCH == 4
    assert auto_micro_batch(8, cpu, None) == (4, 2)  # albert-tiny: 8 samples per step
    assert auto_micro_batch(4, cpu, None) == (4, 1)  # albert-large-v2: 4 x 1
    assert auto_micro_batch(2, cpu, None) == (2, 1)
    assert auto_micro_batch(10, cpu, lambda size: True) == (4, 3)  # a probe is for GPUs only
    assert accumulation_for(4096, 48) == 86


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the memory probe needs a GPU")
def test_the_gpu_probe_finds_a_micro_batch_that_really_fits():
    from cotrain.host.hardware import Precision, gpu_probe, largest_fitting
    from cotrain.models import build_model, forward_loss

    run = cfg.resolve("albert-tiny").run
    device = torch.device("cuda", 0)
    model = build_model(run, vocab_size=1000).to(device)

    def make_batch(size: int) -> dict:
        ids = torch.randint(5, 1000, (size, run.max_seq_length))
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "token_type_ids": torch.zeros_like(ids),
            "labels": ids.clone(),
            "sentence_order_label": torch.zeros(size, dtype=torch.long),
        }

    fits = gpu_probe(model, make_batch, forward_loss, device, Precision(device))
    size = largest_fitting(fits, 64)
    assert size == 64 and fits(size)


def test_pad_batch_makes_the_worst_case_micro_batch():
    from cotrain.host.hardware import pad_batch

    batch = {
        "input_ids": torch.tensor([[2, 7, 3]]),
        "labels": torch.tensor([[-100, 7, -100]]),
        "attention_mask": torch.ones(1, 3, dtype=torch.long),
        "sentence_order_label": torch.tensor([1]),
    }
    out = pad_batch(batch, 5, pad_token_id=0)
    assert out["input_ids"].tolist() == [[2, 7, 3, 0, 0]] and out["labels"].tolist() == [
        [-100, 7, -100, -100, -100]
    ]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0]] and out["sentence_order_label"].tolist() == [1]


def test_devices_on_a_machine_without_gpus():
    from cotrain.host.hardware import resolve_devices

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answers")
    assert resolve_devices("") == [torch.device("cpu")] and resolve_devices("cpu") == [torch.device("cpu")]
    for spec, message in (
        ("all", "no GPU"),
        ("cuda:0", "does not exist"),
        ("tpu", "not a device"),
        ("cpu,cuda", "GPUs only"),
    ):
        with pytest.raises(UserError, match=message):
            resolve_devices(spec)


def _tiny_albert_batch():
    from cotrain.models import build_model

    small = {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1}
    run = cfg.resolve("albert-tiny", overrides={"run": {"model": {**small, "embedding_size": 16}}}).run
    torch.manual_seed(0)
    model = build_model(run, vocab_size=300)
    ids = torch.randint(5, 300, (4, 16))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100)),
        "sentence_order_label": torch.randint(0, 2, (4,)),
    }
    return model, batch


def test_bf16_autocast_on_the_cpu_computes_in_bfloat16_and_keeps_fp32_gradients():
    from cotrain.host.hardware import Precision

    model, batch = _tiny_albert_batch()
    precision = Precision(torch.device("cpu"), bf16=True)
    seen = []
    hook = model.albert.encoder.embedding_hidden_mapping_in.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    with precision.autocast():
        loss = model(**batch).loss
    hook.remove()
    precision.backward(loss)
    precision.unscale(model)
    assert seen == [torch.bfloat16] and precision.name == "bf16" and precision.scaler is None
    assert torch.isfinite(loss) and all(
        p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None
    )


def test_fp16_scales_the_loss_and_hands_true_gradients_on():
    """float16 on the CPU as far as it goes: the loss is scaled for backward, the gradients are unscaled
    before anyone sees them (close to the fp32 ones), and an overflow lowers the scale."""
    from cotrain.host.hardware import Precision

    model, batch = _tiny_albert_batch()
    reference = model(**batch).loss
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    precision = Precision(torch.device("cpu"), fp16=True)
    scale = precision.scaler.get_scale()
    assert scale > 1
    with precision.autocast():
        loss = model(**batch).loss
    precision.backward(loss)
    precision.unscale(model)
    precision.update()
    got = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n in expected])
    want = torch.cat([g.flatten() for g in expected.values()])
    ratio = torch.linalg.vector_norm(got) / torch.linalg.vector_norm(want)
    assert 0.8 < ratio < 1.25, ratio  # unscaled: not x65536
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.95  # the fp32 direction, in fp16
    model.zero_grad(set_to_none=True)
    precision.backward(torch.tensor(float("inf"), requires_grad=True) * next(model.parameters()).sum())
    precision.unscale(model)
    precision.update()
    assert precision.scaler.get_scale() < scale


def test_optimizer_statistics_travel_in_full_precision():
    """Tiny second moments (1e-10, below fp16's smallest subnormal) survive the wire exactly: in downloaded
    state and in any averaged optimizer statistic; parameters and gradients go as fp16."""
    from hivemind.compression import CompressionInfo, TensorRole, deserialize_torch_tensor

    from cotrain.hivemind_ext.optimizer import LOAD_STATE_COMPRESSION, gradient_compression, state_compression

    compression = cfg.resolve("albert-tiny").peer.grad_compression
    exp_avg_sq = torch.full((1000,), 1e-10) * torch.rand(1000)

    def roundtrip(compression, tensor, role):
        info = CompressionInfo.from_tensor(tensor, key=0, role=role)
        return deserialize_torch_tensor(compression.compress(tensor, info, allow_inplace=False))

    assert torch.equal(roundtrip(LOAD_STATE_COMPRESSION, exp_avg_sq, TensorRole.OPTIMIZER), exp_avg_sq)
    assert torch.equal(
        roundtrip(state_compression(compression), exp_avg_sq, TensorRole.OPTIMIZER), exp_avg_sq
    )
    assert torch.equal(
        roundtrip(state_compression(compression), exp_avg_sq, TensorRole.UNSPECIFIED), exp_avg_sq
    )
    flushed = roundtrip(state_compression(compression), exp_avg_sq, TensorRole.PARAMETER)
    assert flushed.abs().max() == 0  # what fp16 would have done to the moments
    weights = torch.randn(1000)
    wire = (
        (state_compression(compression), TensorRole.PARAMETER),
        (gradient_compression(compression), TensorRole.UNSPECIFIED),
    )
    for compression, role in wire:
        out = roundtrip(compression, weights, role)
        assert not torch.equal(out, weights) and torch.allclose(out, weights, rtol=1e-3, atol=1e-4)  # fp16
    plain = cfg.resolve("albert-tiny", overrides={"peer": {"grad_compression": "none"}}).peer.grad_compression
    assert torch.equal(roundtrip(gradient_compression(plain), weights, TensorRole.UNSPECIFIED), weights)


def test_tracker_options_reach_hivemind_with_their_names():
    import inspect

    from hivemind.optim.progress_tracker import ProgressTracker

    from cotrain.hivemind_ext.optimizer import tracker_options
    from cotrain.strategies.builds import tracker_settings

    _, c = cli.parse(
        [
            "train",
            "--preset",
            "albert-tiny",
            "--min_refresh_period",
            "0.25",
            "--max_refresh_period",
            "7",
            "--default_refresh_period",
            "2",
            "--expected_drift_peers",
            "5",
            "--expected_drift_rate",
            "0.3",
            "--metadata_expiration",
            "90",
        ]
    )
    opts = tracker_options(c.peer.matchmaking_time, tracker_settings(c.peer))
    assert opts == {
        "min_refresh_period": 0.25,
        "max_refresh_period": 7.0,
        "default_refresh_period": 2.0,
        "expected_drift_peers": 5.0,
        "expected_drift_rate": 0.3,
        "metadata_expiration": 90.0,
    }
    assert set(opts) <= set(inspect.signature(ProgressTracker).parameters)
    _, c = cli.parse(["train", "--preset", "albert-tiny"])
    opts = tracker_options(c.peer.matchmaking_time, tracker_settings(c.peer))
    assert opts["max_refresh_period"] == max(1.0, 2 * c.peer.matchmaking_time)


def test_outbound_address_lookup_sends_nothing_and_announces_the_listening_port():
    """--use-google-dns asks the kernel which address a UDP socket "connected" to a target would use; here the
    target is loopback (tests never name the public resolver), which must answer 127.0.0.1."""
    from cotrain.net.dht import GOOGLE_DNS, announce_public_address, outbound_address

    assert GOOGLE_DNS[0] == "8.8.8.8"
    loopback = ("127.0.0.1", 9)
    assert outbound_address(loopback) == "127.0.0.1"
    assert announce_public_address(["/ip4/0.0.0.0/tcp/31337"], loopback) == ["/ip4/127.0.0.1/tcp/31337"]
    with pytest.raises(UserError, match="fixed port"):
        announce_public_address(["/ip4/0.0.0.0/tcp/0"], loopback)
    _, c = cli.parse(["monitor", "--use_google_dns"])
    assert c.peer.use_google_dns
    _, c = cli.parse(["monitor"])
    assert not c.peer.use_google_dns  # opt-in


def test_the_flag_table_lists_every_original_spelling():
    from cotrain import flagtable

    seeds = {row[0] for row in flagtable.rows()}
    original = {
        # CollaborationArguments / OptimizerArguments / BaseTrainingArguments
        "--run_id",
        "--experiment_prefix",
        "--initial_peers",
        "--use_ipfs",
        "--host_maddrs",
        "--announce_maddrs",
        "--identity_path",
        "--target_batch_size",
        "--client_mode",
        "--batch_size_lead",
        "--bandwidth",
        "--averaging_timeout",
        "--matchmaking_time",
        "--averaging_expiration",
        "--statistics_expiration",
        "--backup_every_steps",
        "--target_group_size",
        "--min_refresh_period",
        "--max_refresh_period",
        "--default_refresh_period",
        "--expected_drift_peers",
        "--expected_drift_rate",
        "--metadata_expiration",
        "--performance_ema_alpha",
        "--listen_on",
        "--dht_listen_on",
        # DatasetArguments
        "--dataset_path",
        "--tokenizer_path",
        "--config_path",
        "--cache_dir",
        # AlbertTrainingArguments / TrainingArguments
        "--dataloader_num_workers",
        "--per_device_train_batch_size",
        "--per_device_eval_batch_size",
        "--gradient_accumulation_steps",
        "--seq_length",
        "--total_steps",
        "--learning_rate",
        "--warmup_steps",
        "--adam_beta1",
        "--adam_beta2",
        "--adam_epsilon",
        "--weight_decay",
        "--max_grad_norm",
        "--clamp_value",
        "--fp16",
        "--bf16",
        "--output_dir",
        "--overwrite_output_dir",
        "--logging_dir",
        "--logging_steps",
        "--logging_first_step",
        "--save_steps",
        "--save_total_limit",
        "--max_steps",
        "--num_train_epochs",
        "--seed",
        # the fork's trainer
        "--model_name_or_path",
        # TrainingMonitorArguments
        "--use_google_dns",
        "--refresh_period",
        "--wandb_project",
        "--save_checkpoint_step_interval",
        "--model_config_path",
        "--repo_path",
        "--repo_url",
        "--upload_interval",
        "--store_checkpoints",
    }
    assert not original - seeds, sorted(original - seeds)


def test_docs_options_lists_every_option():
    text = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    missing = []
    for cls in cfg.SECTIONS.values():
        for f in dataclasses.fields(cls):
            if f.metadata["roles"] and cfg.cli_flags(f)[0] not in text:
                missing.append(cfg.cli_flags(f)[0])
    assert not missing, f"docs/options.md lacks {missing}"
