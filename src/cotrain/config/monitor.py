"""The monitor's settings (and `cotrain status`'s): how often it reads the swarm, its checkpoints of the
swarm's state, uploads, the dashboard and the metrics sinks."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import negative, not_positive, opt


@dataclass
class MonitorConfig:
    """Monitor: reading the swarm's metrics, checkpoints of its state, uploads, dashboard and sinks."""

    TITLE: ClassVar[str] = "monitor"

    refresh_period: float = opt(
        30.0,
        "Seconds between the monitor's reads of the swarm's metrics.",
        roles=("monitor", "status"),
        seed="--refresh_period",
    )
    save_every: int = opt(
        500,
        "Global steps between the monitor's checkpoints of the swarm's state (0: none).",
        flags=("--save-checkpoint-step-interval",),
        roles=("monitor",),
        seed="--save_checkpoint_step_interval",
    )
    keep_checkpoints: int = opt(3, "Checkpoints the monitor keeps (the newest ones).", roles=("monitor",))
    resume: bool = opt(
        False,
        "Start from the newest good checkpoint in OUTPUT_DIR/checkpoints and serve it to peers.",
        roles=("monitor",),
    )
    reduce: bool = opt(
        True,
        "Reduce all-reduce parts for the trainers as an auxiliary peer (weight 0: it adds no gradient of its "
        "own), so that trainers behind NAT (client mode) average through this public machine; it needs the "
        "model's shapes (--dataset-path, --dataset-url or --tokenizer-path) (--no-reduce: never).",
        roles=("monitor",),
    )
    push_to_hub: str = opt(
        "",
        "Hugging Face Hub repository (user/name) to upload the newest checkpoint to, as a model folder.",
        flags=("--repo-url",),
        roles=("monitor",),
        seed="--repo_url",
    )
    hub_public: bool = opt(
        False,
        "Create the --push-to-hub repository public if it does not exist (default: private; an existing "
        "repository keeps its visibility).",
        roles=("monitor",),
    )
    repo_path: str = opt(
        "",
        "Local folder where the model folder uploaded to --push-to-hub is written (default OUTPUT_DIR/hub).",
        roles=("monitor",),
        seed="--repo_path",
    )
    store_checkpoints: bool = opt(
        True,
        "Keep checkpoints of the swarm's state every --save-every steps (--no-store-checkpoints: none).",
        roles=("monitor",),
        seed="--store_checkpoints",
    )
    upload_every: float = opt(
        3600.0,
        "Seconds between uploads to --push-to-hub.",
        flags=("--upload-interval",),
        roles=("monitor",),
        seed="--upload_interval",
    )
    dashboard_port: int = opt(
        8080,
        "Port of the monitor's live web dashboard (0: any free port; -1: no dashboard).",
        roles=("monitor", "demo"),
    )
    dashboard_host: str = opt(
        "127.0.0.1",
        "Address the dashboard listens on (0.0.0.0 exposes it to other machines).",
        roles=("monitor", "demo"),
    )
    tensorboard_dir: str = opt(
        "", "Also write the swarm's metrics as TensorBoard event files to this folder.", roles=("monitor",)
    )
    wandb_project: str = opt(
        "",
        "Also log the swarm's metrics to this Weights & Biases project (WANDB_MODE=offline works).",
        roles=("monitor",),
        seed="--wandb_project",
    )
    json: bool = opt(False, "Print the swarm's state as one JSON object.", roles=("status",))

    def problems(self) -> list[str]:
        problems = not_positive(self, "refresh_period", "upload_every") + negative(self, "save_every")
        if self.keep_checkpoints < 1:
            problems.append(f"keep_checkpoints must be at least 1, got {self.keep_checkpoints}")
        if not -1 <= self.dashboard_port <= 65535:
            problems.append(
                f"dashboard_port must be -1 (off), 0 (a free port) or a port: {self.dashboard_port}"
            )
        return problems
