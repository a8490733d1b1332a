"""The run: swarm-wide settings, the ones every peer must agree on for the math to be the same (the model and
its tokenizer, the objective, the target batch, the optimizer and its schedule). Peers publish them signed,
with their hash, and a peer whose settings differ is refused."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.algorithms.parameters import option_problems
from cotrain.config.fields import ROLES_ALL, finite_problems, not_positive, opt
from cotrain.families import family_problems
from cotrain.registry import AGGREGATIONS, STRATEGIES, aggregation_parameters, codec, codec_names

# the outer step of sparse rounds unless given (SparseLoCo's): error feedback in place of momentum; a live
# swarm with topk and the dense defaults (lr 0.7, Nesterov 0.9) diverged (docs/diloco.md)
TOPK_OUTER_STEP = {"outer_lr": 1.0, "outer_momentum": 0.0}
# dense rounds of a run planned for fewer than SHORT_RUN_ROUNDS outer rounds (--total-steps / --local-steps)
# step as FedAvg does unless given: the DiLoCo paper's Nesterov step (0.7, 0.9), chosen for runs of hundreds
# of rounds, keeps pushing along earlier rounds' direction once the inner schedule has decayed, and ended 7%
# behind synchronous training at 10 rounds (docs/benchmarks.md); with --outer-overlap, lr 0.5 (a gain below
# 1: a delayed step is stable only then)
SHORT_RUN_ROUNDS = 100
SHORT_RUN_OUTER_STEP = {"outer_lr": 1.0, "outer_momentum": 0.0}
SHORT_RUN_OVERLAP_OUTER_STEP = {"outer_lr": 0.5, "outer_momentum": 0.0}


def outer_step_defaults(run: dict) -> dict:
    """The outer step's settings that the run's other settings choose where not given (``run``: the run
    config's values): SparseLoCo's for sparse rounds, FedAvg's for a short run of dense rounds, none else."""
    if run.get("strategy") != "diloco":
        return {}
    if run.get("outer_compression") == "topk":
        return TOPK_OUTER_STEP
    local_steps, total_steps = run.get("local_steps"), run.get("total_steps")
    if isinstance(local_steps, int) and isinstance(total_steps, int) and local_steps > 0:
        if total_steps < SHORT_RUN_ROUNDS * local_steps:
            return SHORT_RUN_OVERLAP_OUTER_STEP if run.get("outer_overlap") else SHORT_RUN_OUTER_STEP
    return {}


# settings that were swarm-wide once and are each peer's own now: a [run] table (an older file or preset)
# may still name them, and they are then read as [peer] settings
MOVED_TO_PEER = ("matchmaking_time", "averaging_timeout", "grad_compression")


@dataclass
class RunConfig:
    """Swarm-wide settings: every peer of a run must agree on them."""

    TITLE: ClassVar[str] = "run"

    run_id: str = opt(
        "cotrain",
        "Name of the training run; peers with the same run id train together (no dots).",
        flags=("--experiment-prefix",),
        seed=("--experiment_prefix", "--run_id"),
    )
    preset: str = opt(
        "albert-large-v2",
        "Name of the shipped preset this config starts from.",
        roles=ROLES_ALL + ("prepare",),
    )
    model_family: str = opt(
        "albert",
        "Model family: albert (sentence order + masked LM), bert, distilbert, roberta (masked LM), gpt2, "
        "llama or qwen2 (causal LM).",
        roles=(),
    )
    objective: str = opt(
        "sop+mlm",
        "Training objective, the family's: sop+mlm (albert), mlm (bert, distilbert, roberta) or clm (gpt2, "
        "llama, qwen2); `cotrain prepare` makes these examples.",
        roles=(),
    )
    model: dict = opt(
        {}, "Model architecture ([model] table: hidden_size, num_attention_heads, ...).", roles=()
    )
    max_seq_length: int = opt(
        512,
        "Sequence length of the training examples (tokens).",
        flags=("--seq-length",),
        roles=ROLES_ALL + ("prepare",),
        seed="--seq_length",
    )
    mlm_probability: float = opt(0.15, "Fraction of tokens masked for the masked-LM objective.")
    whole_word_mask: bool = opt(
        False, "Masked LM: mask all the pieces of a word together (whole-word masking)."
    )
    init_from: str = opt(
        "",
        "Start from pretrained weights: a Hugging Face model folder (offline) or a Hub model name (needs a "
        "network); its architecture replaces [run.model]. Give every peer the same value.",
        flags=("--model-name-or-path",),
        seed="--model_name_or_path",
    )
    target_batch_size: int = opt(
        4096,
        "Samples the whole swarm accumulates before each global optimizer step.",
        seed="--target_batch_size",
    )
    optimizer: str = opt("lamb", "Optimizer: lamb (the seed recipe) or adamw.")
    lr_scheduler: str = opt(
        "linear",
        "Learning-rate decay after the linear warmup, stepped once per global step: linear or cosine.",
    )
    learning_rate: float = opt(0.00176, "Peak learning rate.", seed="--learning_rate")
    adam_beta1: float = opt(0.9, "First-moment decay of LAMB/Adam.", seed="--adam_beta1")
    adam_beta2: float = opt(0.999, "Second-moment decay of LAMB/Adam.", seed="--adam_beta2")
    adam_epsilon: float = opt(1e-6, "Epsilon of LAMB/Adam.", seed="--adam_epsilon")
    weight_decay: float = opt(
        0.01, "Weight decay (none on biases and LayerNorm weights).", seed="--weight_decay"
    )
    clamp_value: float = opt(10000.0, "LAMB's clamp on the weight norm.", seed="--clamp_value")
    max_grad_norm: float = opt(
        1.0, "Clip each micro-batch's gradient norm to this value (0 disables).", seed="--max_grad_norm"
    )
    warmup_steps: int = opt(5000, "Global steps of linear learning-rate warmup.", seed="--warmup_steps")
    total_steps: int = opt(
        125000, "Global steps of the whole schedule (decay to zero).", seed="--total_steps"
    )
    strategy: str = opt(
        "sync",
        "Training strategy: sync (gradients averaged at every global step, the seed recipe) or diloco (each "
        "peer takes --local-steps steps of the preset's optimizer alone, then the swarm averages the change "
        "of the parameters and takes one outer Nesterov step: per sample, about 2 x --local-steps times less "
        "traffic).",
    )
    local_steps: int = opt(
        50,
        "diloco: H, a round's length in target batches of the swarm: a round ends when the swarm has "
        "accumulated local_steps x target_batch_size samples (each peer takes one inner optimizer step per "
        "step of its own meanwhile); the inner schedule moves H steps per round, and warmup_steps and "
        "total_steps count its steps.",
    )
    outer_lr: float = opt(
        0.7,
        "diloco: learning rate of the outer SGD (Nesterov) step (topk, or a run of fewer than 100 rounds: 1 "
        "by default; with --outer-overlap 0.5).",
    )
    outer_momentum: float = opt(
        0.9,
        "diloco: Nesterov momentum of the outer SGD step (topk, or a run of fewer than 100 rounds, "
        "--total-steps / --local-steps: 0 by default).",
    )
    outer_overlap: bool = opt(
        False,
        "diloco: run a round's all-reduce in the background while the next round's inner steps compute, "
        "and apply its outer step one round late, so compute never waits for the network.",
    )
    outer_compression: str = opt(
        "dense",
        "diloco: how a round's pseudo-gradients travel: dense (as each peer's --grad-compression says) or "
        "topk (the largest --topk-density of every chunk of 4096 values, in --topk-bits bits, with error "
        "feedback: 97x fewer bytes than fp16 at the defaults; docs/diloco.md). Swarm-wide.",
    )
    outer_compression_options: dict = opt(
        {},
        "A records codec's parameters other than topk's own flags, NAME=VALUE (repeat the flag for each; "
        "[run.outer_compression_options] in a file), checked against those the codec declares. Swarm-wide.",
        flags=("--outer-compression-option",),
    )
    topk_density: float = opt(
        1 / 64, "topk: the share of each chunk's values a peer sends per round (a multiple of 8 per chunk)."
    )
    topk_bits: int = opt(
        2, "topk: bits per value sent (2, 4 or 8): a sign and one of the chunk's levels of magnitude."
    )
    topk_feedback_decay: float = opt(
        0.9,
        "topk: what a peer did not send joins its next round's change times this (1: all of it); a decay "
        "below 1 lets stale values fade (docs/diloco.md).",
    )
    aggregation: str = opt(
        "mean",
        "How the reducer of each part of an all-reduce combines the group's contributions (gradients; "
        "diloco: parameter changes): mean (weighted by samples) or centered-clip (CenteredClip, robust to "
        "malicious peers: no single contribution moves a part by more than its share of --clip-tau, "
        "weights are capped at their median; docs/security.md). Swarm-wide. Contributions of the wrong "
        "shape or with NaN/Inf are dropped either way.",
    )
    clip_tau: str = opt(
        "auto",
        "centered-clip: the clipping radius on a part's L2 norm, or auto (2 x the median distance of the "
        "contributions from their coordinate-wise median, per part).",
    )
    clip_iterations: int = opt(5, "centered-clip: iterations per part.")
    aggregation_options: dict = opt(
        {},
        "The aggregation's parameters other than --clip-tau and --clip-iterations, NAME=VALUE (repeat the "
        "flag for each; [run.aggregation_options] in a file), checked against those its registry line "
        "declares (cotrain.registry). Swarm-wide.",
        flags=("--aggregation-option",),
    )

    @classmethod
    def from_dict(cls, values: dict) -> "RunConfig":
        """A RunConfig from its dict (a checkpoint's or a record's), ignoring the per-peer settings that older
        versions kept here."""
        return cls(**{k: v for k, v in values.items() if k not in MOVED_TO_PEER})

    def problems(self) -> list[str]:
        problems = finite_problems(self)
        if not self.run_id or "." in self.run_id or "/" in self.run_id:
            problems.append(f"run_id {self.run_id!r} must be non-empty and contain no '.' or '/'")
        problems += not_positive(self, "target_batch_size", "max_seq_length", "total_steps")
        if self.warmup_steps < 0 or self.warmup_steps > self.total_steps:
            problems.append(
                f"warmup_steps must be between 0 and total_steps ({self.total_steps}), "
                f"got {self.warmup_steps}"
            )
        if self.learning_rate <= 0:
            problems.append(f"learning_rate must be positive, got {self.learning_rate}")
        if not 0 < self.mlm_probability < 1:
            problems.append(f"mlm_probability must be between 0 and 1, got {self.mlm_probability}")
        if self.optimizer not in ("lamb", "adamw"):
            problems.append(f"optimizer must be lamb or adamw, got {self.optimizer!r}")
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        problems += not_positive(self, "local_steps")
        if self.outer_lr <= 0:
            problems.append(f"outer_lr must be positive, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            problems.append(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.aggregation not in AGGREGATIONS:  # cotrain.registry: the parts every peer knows
            problems.append(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        else:
            what, parameters = f"aggregation {self.aggregation}", aggregation_parameters(self.aggregation)
            problems += option_problems(what, parameters, self.aggregation_options)
        problems += _outer_compression_problems(self)
        if not _tau_ok(self.clip_tau):
            problems.append(f"clip_tau must be auto or a positive number, got {self.clip_tau!r}")
        problems += not_positive(self, "clip_iterations")
        if self.lr_scheduler not in ("linear", "cosine"):
            problems.append(f"lr_scheduler must be linear or cosine, got {self.lr_scheduler!r}")
        return problems + family_problems(self.model_family, self.objective)


def _outer_compression_problems(run: "RunConfig") -> list[str]:
    records = codec_names("records")  # cotrain.registry
    problems = []
    for name in records:  # the records codecs' parameters that run fields set (topk's), whichever is chosen
        for p in codec(name).parameters.values():
            if p.field and p.check is not None and (problem := p.check(getattr(run, p.field))):
                problems.append(f"{p.field} {problem}")
    if run.outer_compression not in ("dense", *records):
        choices = ", ".join(("dense", *records))
        return problems + [f"outer_compression must be one of {choices}, got {run.outer_compression!r}"]
    if run.outer_compression == "dense":
        if run.outer_compression_options:
            problems.append("outer_compression_options are a records codec's: dense rounds take none")
        return problems
    what = f"outer_compression {run.outer_compression}"
    problems += option_problems(what, codec(run.outer_compression).parameters, run.outer_compression_options)
    if run.strategy != "diloco":
        problems.append(f"{what} compresses DiLoCo's rounds: it needs --strategy diloco")
    if run.aggregation != "mean":
        problems.append(f"{what} averages sparse records with the mean only, not {run.aggregation}")
    return problems


def _tau_ok(value: str) -> bool:
    if str(value).strip().lower() == "auto":
        return True
    try:
        return float(value) > 0
    except ValueError:
        return False
