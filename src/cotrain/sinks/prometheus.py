"""Prometheus gauges of the swarm, served on the dashboard's ``/metrics``; needs the ``dashboard`` extra."""

from __future__ import annotations

from cotrain.sinks.base import Sink, scalars

STEP_METRICS = {
    "loss": "Mean training loss of the swarm at the last global step.",
    "alive_peers": "Peers with a live metrics record.",
    "samples": "Samples the swarm's live peers have contributed in total.",
    "samples_per_second": "Swarm throughput in samples per second.",
    "max_group_size": "Largest gradient-averaging group at the last global step.",
    "client_peers": "Live peers in client mode.",
}
EVAL_METRICS = {
    "eval_step": "Global step of the state the evaluation peer measured last.",
    "eval_loss": "Held-out loss of the swarm's state (the training objective).",
    "eval_perplexity": "Held-out perplexity of the swarm's state.",
    "eval_mlm_accuracy": "Share of held-out masked tokens predicted exactly.",
    "eval_sop_accuracy": "Share of held-out sentence pairs whose order is predicted right (ALBERT).",
}
PROGRESS_METRICS = {
    "samples_accumulated": "Samples accumulated toward the next global step.",
    "target_batch_size": "Samples the swarm accumulates per global step.",
    "eta_seconds": "Estimated seconds until the next global step.",
}


class PrometheusSink(Sink):
    def __init__(self, run_id: str):
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        self.step = Gauge(
            "cotrain_global_step", "The swarm's global step.", ["run_id"], registry=self.registry
        )
        self.gauges = {
            name: Gauge(f"cotrain_{name}", doc, ["run_id"], registry=self.registry)
            for name, doc in {**STEP_METRICS, **PROGRESS_METRICS, **EVAL_METRICS}.items()
        }
        self.run_id = run_id

    def write(self, step: int, metrics: dict) -> None:
        if metrics.get("kind") == "eval":  # an evaluation peer's row: its step is the evaluated state's
            metrics = {**metrics, "eval_step": step}
        else:
            self.step.labels(self.run_id).set(step)
        for name, value in scalars(metrics).items():
            if name in self.gauges:
                self.gauges[name].labels(self.run_id).set(value)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
