"""How a peer averages with others: matchmaking, timeouts, compression of what it sends, group size, how
often it reads the swarm's progress, and hivemind's background (delayed) updates. Each peer tunes these to
its own link and hardware; peers with different values still average together."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.algorithms.parameters import option_problems
from cotrain.config.fields import negative, not_positive, opt
from cotrain.registry import codec, codec_names

AVERAGING_ROLES = ("train", "demo")


def grad_compression_problems(name: str, options: dict) -> list[str]:
    """What is wrong with a peer's --grad-compression and its options: a dense codec of cotrain.registry, and
    the parameters it declares."""
    choices = codec_names("dense")
    if name not in choices:
        return [f"grad_compression must be one of {', '.join(choices)}, got {name!r}"]
    return option_problems(f"grad_compression {name}", codec(name).parameters, options)


@dataclass
class AveragingConfig:
    """Averaging: this peer's matchmaking, timeouts, compression, group size and progress tracking."""

    TITLE: ClassVar[str] = "averaging"

    matchmaking_time: float = opt(
        5.0,
        "Seconds this peer waits for others to form an averaging group (raise it on a high-latency link).",
        flags=("--averaging-expiration",),
        roles=("train", "monitor", "eval", "demo"),
        seed=("--averaging_expiration", "--matchmaking_time"),
    )
    averaging_timeout: float = opt(
        60.0,
        "Seconds before an averaging round is given up.",
        roles=("train", "monitor", "eval", "demo"),
        seed="--averaging_timeout",
    )
    grad_compression: str = opt(
        "fp16",
        "Compression of the gradients (diloco: the parameter changes) and parameters this peer sends: fp16, "
        "8bit (hivemind's uniform 8-bit quantization) or none (optimizer statistics and downloaded state "
        "always travel in full precision).",
        roles=("train", "monitor", "eval", "demo"),
    )
    grad_compression_options: dict = opt(
        {},
        "The parameters of a --grad-compression codec that takes some, NAME=VALUE (repeat the flag for each; "
        "[peer.grad_compression_options] in a file), checked against those it declares (cotrain.registry).",
        flags=("--grad-compression-option",),
        roles=("train", "monitor", "eval", "demo"),
    )
    target_group_size: int = opt(
        256,
        "Largest all-reduce group this peer averages in.",
        roles=AVERAGING_ROLES,
        seed="--target_group_size",
    )
    batch_size_lead: int = opt(
        0,
        "Start averaging this many samples before the target batch is reached.",
        roles=AVERAGING_ROLES,
        seed="--batch_size_lead",
    )
    bandwidth: float = opt(
        0.0,
        "This peer's network bandwidth in Mbit/s, to balance all-reduce load (0: unknown).",
        roles=AVERAGING_ROLES,
        seed="--bandwidth",
    )
    direct_allreduce: bool = opt(
        True,
        "Send all-reduce parts to peers that can be reached over a direct TCP connection (negotiated and "
        "encrypted over libp2p; libp2p otherwise). --no-direct-allreduce: always libp2p.",
        roles=AVERAGING_ROLES,
    )
    min_refresh_period: float = opt(
        0.5,
        "Fewest seconds between this peer's reads of the swarm's progress.",
        roles=AVERAGING_ROLES,
        seed="--min_refresh_period",
    )
    max_refresh_period: float = opt(
        0.0,
        "Most seconds between reads of the swarm's progress (0: twice --matchmaking-time, at least 1).",
        roles=AVERAGING_ROLES,
        seed="--max_refresh_period",
    )
    default_refresh_period: float = opt(
        3.0,
        "Seconds between reads of the swarm's progress while it cannot be estimated.",
        roles=AVERAGING_ROLES,
        seed="--default_refresh_period",
    )
    expected_drift_peers: float = opt(
        3.0,
        "Peers the progress tracker expects may join per step (it refreshes sooner for them).",
        roles=AVERAGING_ROLES,
        seed="--expected_drift_peers",
    )
    expected_drift_rate: float = opt(
        0.2,
        "Fraction of the swarm the progress tracker expects may join per step.",
        roles=AVERAGING_ROLES,
        seed="--expected_drift_rate",
    )
    metadata_expiration: float = opt(
        60.0,
        "Seconds this peer's progress record stays valid in the DHT (the original recipe used 120).",
        roles=AVERAGING_ROLES,
        seed="--metadata_expiration",
    )
    performance_ema_alpha: float = opt(
        0.1,
        "Smoothing of this peer's samples/s estimate (moving-average weight of the newest step).",
        roles=AVERAGING_ROLES,
        seed="--performance_ema_alpha",
    )
    offload_optimizer: bool = opt(
        True,
        "Keep the optimizer's parameters and statistics in host memory (--no-offload-optimizer: on the "
        "device).",
        roles=AVERAGING_ROLES,
    )
    delay_optimizer_step: bool = opt(
        False,
        "Run the optimizer step in the background while the next micro-batches compute (parameters lag one "
        "step).",
        roles=AVERAGING_ROLES,
    )
    delay_grad_averaging: bool = opt(
        False,
        "Average gradients in the background too (implies --delay-optimizer-step).",
        roles=AVERAGING_ROLES,
    )
    delay_state_averaging: bool = opt(
        True,
        "Average parameters with peers in the background (--no-delay-state-averaging: wait for it).",
        roles=AVERAGING_ROLES,
    )
    load_state_timeout: float = opt(
        60.0,
        "Seconds to wait for the current model state from other peers (joining; a monitor's checkpoint).",
        roles=("train", "monitor", "eval"),
    )

    def problems(self) -> list[str]:
        problems = []
        problems += grad_compression_problems(self.grad_compression, self.grad_compression_options)
        problems += not_positive(
            self,
            "matchmaking_time",
            "averaging_timeout",
            "min_refresh_period",
            "default_refresh_period",
            "metadata_expiration",
            "load_state_timeout",
        )
        problems += negative(
            self,
            "max_refresh_period",
            "batch_size_lead",
            "bandwidth",
            "expected_drift_peers",
            "expected_drift_rate",
        )
        if self.target_group_size < 2:
            problems.append(f"target_group_size must be at least 2, got {self.target_group_size}")
        if 0 < self.max_refresh_period < self.min_refresh_period:
            problems.append("max_refresh_period must not be below min_refresh_period")
        if not 0 < self.performance_ema_alpha <= 1:
            problems.append(f"performance_ema_alpha must be in (0, 1], got {self.performance_ema_alpha}")
        if (self.delay_optimizer_step or self.delay_grad_averaging) and not self.offload_optimizer:
            problems.append("delay_optimizer_step and delay_grad_averaging need offload_optimizer")
        return problems
