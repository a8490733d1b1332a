"""Strategies, aggregations and codecs are parts.

Here, in the test process alone; the rest in tests/live/test_parts.py."""

from __future__ import annotations

import pytest
import torch

from cotrain import registry
from cotrain.algorithms.aggregation import Aggregation, build
from cotrain.algorithms.codecs import Codec
from cotrain.algorithms.parameters import Parameter
from cotrain.config import RunConfig
from cotrain.strategies.base import Strategy


class _Trimmed(Aggregation):
    name = "trimmed-mean-again"


def test_the_registries_name_the_parts_and_refuse_what_they_cannot_hold():
    assert list(registry.STRATEGIES)[:2] == ["sync", "diloco"]
    assert issubclass(registry.strategy_class("sync"), Strategy)
    assert issubclass(registry.strategy_class("diloco"), Strategy)
    with pytest.raises(ValueError, match="unknown strategy 'nope'; choose one of: sync, diloco"):
        registry.strategy_class("nope")
    with pytest.raises(ValueError, match="registered already"):
        registry.register_aggregation("mean", _Trimmed)
    with pytest.raises(ValueError, match="without dots"):
        registry.register_strategy("a.b", Strategy)
    assert "strategy must be one of sync, diloco" in " ".join(RunConfig(strategy="nope").problems())
    # a part registered by name is a choice of the run's config at once, and builds with the run's settings
    try:
        registry.register_aggregation("trimmed-mean-again", _Trimmed)
        assert RunConfig(aggregation="trimmed-mean-again").problems() == []
        assert build("trimmed-mean-again", tau=2.0) == _Trimmed(tau=2.0)
    finally:
        registry.AGGREGATIONS.pop("trimmed-mean-again", None)
    # the interface is abstract: a strategy that leaves a method out cannot be built
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (Strategy,), {})()


def test_the_mean_and_centered_clip_parts_combine_as_their_names_say():
    parts = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [100.0, -100.0]])
    weights = torch.tensor([1.0, 1.0, 2.0, 1.0])
    mean, judged = build("mean").combine(parts, weights)
    torch.testing.assert_close(mean, (weights @ parts) / weights.sum())
    assert judged is None
    clipped, far = build("centered-clip").combine(parts, weights)
    assert far.tolist() == [False, False, False, True]  # the outlier, and only it
    assert (clipped - parts[:3].mean(0)).norm() < (mean - parts[:3].mean(0)).norm()


def _cut(value: float) -> str:
    return "" if 0 <= value < 0.5 else f"must be in [0, 0.5), got {value}"


def test_a_parts_parameters_come_from_the_runs_config_checked_against_its_registry_line(tmp_path):
    from cotrain import cli
    from cotrain.config import config_from_dict, config_hash, resolve
    from cotrain.config.averaging import AveragingConfig
    from cotrain.config.fields import ConfigError
    from cotrain.errors import UserError
    from cotrain.strategies.builds import aggregation_of, grad_compression_of, round_codec

    try:
        registry.register_aggregation("cut-mean", _Trimmed, {"trim": Parameter(0.25, "cut", check=_cut)})
        # the parameters reach the part, over their defaults; its others are refused, each by name, at once
        assert build("cut-mean").options == {"trim": 0.25}
        assert aggregation_of(
            RunConfig(aggregation="cut-mean", aggregation_options={"trim": 0.1})
        ) == _Trimmed(trim=0.1)
        problems = RunConfig(aggregation="cut-mean", aggregation_options={"trim": 0.7, "cut": 1}).problems()
        assert problems == [
            "aggregation cut-mean's trim: must be in [0, 0.5), got 0.7",
            "aggregation cut-mean has no parameter 'cut' (its options: trim)",
        ], problems
        assert "expected float, got str 'x'" in " ".join(
            RunConfig(aggregation="cut-mean", aggregation_options={"trim": "x"}).problems()
        )
        with pytest.raises(ValueError, match="no parameter 'cut'"):
            build("cut-mean", cut=1)
        # the built-in parts' parameters keep their own flags: one spelling each
        assert "set by clip_tau (--clip-tau)" in " ".join(
            RunConfig(aggregation="centered-clip", aggregation_options={"tau": 2.0}).problems()
        )
        assert "no parameter 'trim' (it takes no options)" in " ".join(
            RunConfig(aggregation_options={"trim": 0.1}).problems()
        )
        # the command line (repeatable NAME=VALUE, read as TOML values) and a file's table carry them alike
        argv = [
            "train",
            "--preset",
            "llama-tiny",
            "--aggregation",
            "cut-mean",
            "--aggregation-option",
            "trim=0.1",
        ]
        _, config = cli.parse(argv)
        assert config.run.aggregation_options == {"trim": 0.1}
        toml = tmp_path / "run.toml"
        toml.write_text('[run]\naggregation = "cut-mean"\n[run.aggregation_options]\ntrim = 0.1\n')
        from_file = resolve(preset="llama-tiny", config_file=str(toml))
        assert config_hash(from_file.run) == config_hash(config.run)  # peers that agree hash alike
        assert config_hash(from_file.run) != config_hash(resolve(preset="llama-tiny").run)
        with pytest.raises(UserError, match="expected NAME=VALUE"):
            cli.parse(["train", "--preset", "llama-tiny", "--aggregation-option", "trim"])
        with pytest.raises(ConfigError, match=r"trim: must be in \[0, 0.5\), got 0.9"):
            cli.parse([*argv[:-1], "trim=0.9"])
        # a config written before these fields existed loads, with no options
        old = resolve(preset="llama-tiny").to_dict()
        del old["run"]["aggregation_options"], old["run"]["outer_compression_options"]
        del old["peer"]["grad_compression_options"]
        assert config_from_dict(old).run.aggregation_options == {}
    finally:
        registry.AGGREGATIONS.pop("cut-mean", None)
        registry.AGGREGATION_PARAMETERS.pop("cut-mean", None)

    # codecs: the choices of --grad-compression and --outer-compression, with their bytes per value
    assert registry.codec_names("dense") == ("fp16", "8bit", "none")
    assert registry.codec_names("records") == ("topk",)
    assert [registry.codec(n).bytes_per_value for n in ("fp16", "8bit", "none")] == [2, 1, 4]
    assert (
        type(grad_compression_of(AveragingConfig(grad_compression="8bit"))).__name__
        == "Uniform8BitQuantization"
    )
    topk = round_codec(
        RunConfig(strategy="diloco", outer_compression="topk", topk_bits=4, topk_density=1 / 16)
    )
    assert (topk.bits, topk.density, topk.decay) == (4, 1 / 16, 0.9)
    assert "topk_bits must be one of 2, 4, 8, got 3" in RunConfig(topk_bits=3).problems()
    assert "set by topk_density" in " ".join(
        RunConfig(
            strategy="diloco", outer_compression="topk", outer_compression_options={"density": 0.1}
        ).problems()
    )
    half = Codec("dense", 2, "hivemind.compression:Float16Compression", {"scale": Parameter(1.0)})
    try:
        registry.register_codec("half", half)
        assert (
            AveragingConfig(grad_compression="half", grad_compression_options={"scale": 2}).problems() == []
        )
        assert AveragingConfig(grad_compression="half", grad_compression_options={"bias": 1}).problems() == [
            "grad_compression half has no parameter 'bias' (its options: scale)"
        ]
        assert "must be one of dense, topk, got 'half'" in " ".join(
            RunConfig(outer_compression="half").problems()
        )
        with pytest.raises(ValueError, match="registered already"):
            registry.register_codec("half", registry.codec("fp16"))
    finally:
        registry.CODECS.pop("half", None)
    assert (
        "grad_compression must be one of fp16, 8bit, none, got 'half'"
        in AveragingConfig(grad_compression="half").problems()
    )
    with pytest.raises(ValueError, match="without dots"):
        registry.register_codec("a.b", half)
    with pytest.raises(ValueError, match="names the dense rounds"):
        registry.register_codec("dense", half)
    with pytest.raises(ValueError, match="is a cotrain.algorithms.codecs.Codec"):
        registry.register_codec("half", object())
    with pytest.raises(ValueError, match="kind is one of dense, records"):
        Codec("sparse", 1, "x:y")
    with pytest.raises(ValueError, match="not a Parameter"):
        registry.register_aggregation("cut-mean", _Trimmed, {"trim": 0.25})
    with pytest.raises(ValueError, match="unknown codec 'nope'; choose one of: fp16, 8bit, none, topk"):
        registry.codec("nope")
