"""The evaluation peer's settings (`cotrain eval`)."""

from dataclasses import dataclass
from typing import ClassVar

from cotrain.config.fields import not_positive, opt


@dataclass
class EvaluationConfig:
    """Evaluation: how often, and on how many held-out batches, the evaluation peer measures the swarm."""

    TITLE: ClassVar[str] = "evaluation"

    eval_every: float = opt(
        60.0, "Seconds between the evaluation peer's runs on the swarm's latest state.", roles=("eval",)
    )
    eval_batches: int = opt(
        16, "Held-out batches per evaluation: the same batches (and masks) every time.", roles=("eval",)
    )
    per_device_eval_batch_size: int = opt(
        8, "Samples per evaluation batch.", roles=("eval",), seed="--per_device_eval_batch_size"
    )

    def problems(self) -> list[str]:
        problems = not_positive(self, "eval_every")
        if self.eval_batches < 1 or self.per_device_eval_batch_size < 1:
            problems.append("eval_batches and per_device_eval_batch_size must be at least 1")
        return problems
