"""A trainer's own settings: micro-batches and precision on its devices, when it stops, what it logs, its
NaN guard and its local checkpoints."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import AUTO, negative, not_positive, opt


@dataclass
class TrainerConfig:
    """Trainer: micro-batches, devices and precision, stopping, logging, backups and local checkpoints."""

    TITLE: ClassVar[str] = "trainer"

    per_device_train_batch_size: int = opt(
        4,
        "Samples per micro-batch on each device of this peer, or auto: the largest that fits the GPU's "
        "memory, with gradient accumulation making up the preset's samples per step (on a CPU: 4).",
        roles=("train", "demo"),
        seed="--per_device_train_batch_size",
        auto=True,
    )
    gradient_accumulation_steps: int = opt(
        1,
        "Micro-batches accumulated per optimizer.step call.",
        roles=("train", "demo"),
        seed="--gradient_accumulation_steps",
    )
    max_steps: int = opt(
        0, "Stop after this many global steps of the swarm (0: never).", roles=("train",), seed="--max_steps"
    )
    devices: str = opt(
        "",
        "Devices this peer trains on: cpu, cuda, cuda:1, a list (cuda:0,cuda:1) or all (every local GPU: "
        "a rank each, the model sharded with FSDP2, with DiLoCo; DataParallel with sync); default: the first "
        "GPU, else the CPU.",
        roles=("train",),
    )
    nproc_per_node: int = opt(
        0,
        "Ranks (processes) of this peer, one per GPU of --devices (or all on the CPU with --devices cpu), "
        "training one model sharded with FSDP2; the swarm sees one peer. 0: one per GPU that --devices lists "
        "with --strategy diloco, else 1 (several GPUs under sync: DataParallel). Under torchrun: its world "
        "size.",
        roles=("train",),
    )
    fp16: bool = opt(
        False,
        "Mixed precision in float16: torch.autocast with loss scaling (each micro-batch's gradients are "
        "unscaled and checked before the swarm sees them).",
        roles=("train",),
        seed="--fp16",
    )
    bf16: bool = opt(
        False,
        "Mixed precision in bfloat16: torch.autocast (no loss scaling).",
        roles=("train",),
        seed="--bf16",
    )
    gradient_checkpointing: bool = opt(
        False,
        "Recompute each layer's activations in the backward pass instead of keeping them: less GPU memory "
        "for a bigger model or micro-batch, about a third more compute (not for ALBERT).",
        roles=("train",),
    )
    dataloader_num_workers: int = opt(
        0,
        "Worker processes that load and collate micro-batches from a local --dataset-path "
        "(0: in the training process).",
        roles=("train",),
        seed="--dataloader_num_workers",
    )
    num_train_epochs: float = opt(
        0.0,
        "Stop after this many passes over this peer's training examples (0: no limit).",
        roles=("train",),
        seed="--num_train_epochs",
    )
    logging_dir: str = opt(
        "",
        "Folder for TensorBoard event files of this trainer's logged steps (needs tensorboard; none when "
        "empty).",
        roles=("train",),
        seed="--logging_dir",
    )
    logging_steps: int = opt(
        1,
        "Log a line (and write --logging-dir) every N global steps; the swarm's record is published every "
        "step.",
        roles=("train",),
        seed="--logging_steps",
    )
    logging_first_step: bool = opt(
        False,
        "Also log the first global step this trainer completes.",
        roles=("train",),
        seed="--logging_first_step",
    )
    statistics_expiration: float = opt(
        600.0,
        "Seconds a published metrics record stays valid in the DHT.",
        roles=("train", "eval"),
        seed="--statistics_expiration",
    )
    backup_every_steps: int = opt(
        10,
        "Keep an in-memory copy of the model and optimizer state every N global steps; when the loss or the "
        "parameters turn NaN/inf, restore it, reload the swarm's state and keep training (0: off).",
        roles=("train",),
        seed="--backup_every_steps",
    )
    save_steps: int = opt(
        500,
        "Global steps between this trainer's local checkpoints in OUTPUT_DIR/checkpoints (0: none).",
        roles=("train",),
        seed="--save_steps",
    )
    save_total_limit: int = opt(
        2, "Local checkpoints a trainer keeps (the newest ones).", roles=("train",), seed="--save_total_limit"
    )
    overwrite_output_dir: bool = opt(
        False,
        "Do not resume from the checkpoints in OUTPUT_DIR/checkpoints (start from the swarm or afresh).",
        roles=("train",),
        seed="--overwrite_output_dir",
    )
    resume_from: str = opt(
        "", "Resume this trainer from this checkpoint folder, then catch up with the swarm.", roles=("train",)
    )

    def problems(self) -> list[str]:
        problems = []
        if self.per_device_train_batch_size < 1 and self.per_device_train_batch_size != AUTO:
            problems.append(
                "per_device_train_batch_size must be positive or auto, got "
                f"{self.per_device_train_batch_size}"
            )
        problems += not_positive(self, "gradient_accumulation_steps", "statistics_expiration")
        if self.fp16 and self.bf16:
            problems.append("give --fp16 or --bf16, not both")
        problems += negative(
            self,
            "max_steps",
            "backup_every_steps",
            "dataloader_num_workers",
            "num_train_epochs",
            "save_steps",
            "nproc_per_node",
        )
        if self.logging_steps < 1:
            problems.append(f"logging_steps must be at least 1, got {self.logging_steps}")
        if self.save_total_limit < 1:
            problems.append(f"save_total_limit must be at least 1, got {self.save_total_limit}")
        return problems
