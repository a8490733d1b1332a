"""Every DHT key of a run, named from its run id in one place.

cotrain stores some of these itself; hivemind builds the others from the run id
(``hivemind.Optimizer(run_id=...)``) or from a schema's field names: ``SchemaValidator(schema,
prefix=run_id)`` guards ``{prefix}_{field}``. Those are spelled here the way hivemind spells them, so that
cotrain's readers (status, the monitor, the state keeper) read the very keys hivemind writes;
tests/swarm/test_records.py checks these spellings against hivemind's own.
"""

from __future__ import annotations

RUNS_KEY = "cotrain_runs"  # shared by all runs: each peer stores its run id here (a mistyped one is named)


def metrics_key(run_id: str) -> str:
    """Each trainer's metrics record per global step (``MetricsSchema.metrics`` under prefix ``run_id``)."""
    return f"{run_id}_metrics"


def eval_key(run_id: str) -> str:
    """Each evaluation peer's held-out results (``EvalSchema.eval`` under prefix ``run_id``)."""
    return f"{run_id}_eval"


def config_key(run_id: str) -> str:
    """Each peer's signed run config and its hash (``ConfigSchema.config`` under prefix ``run_id``)."""
    return f"{run_id}_config"


def runs_key() -> str:
    """The run ids that exist (``RunsSchema.cotrain_runs``, no prefix)."""
    return RUNS_KEY


def progress_key(run_id: str) -> str:
    """hivemind's ``ProgressTracker`` records (epoch, samples, samples/s per peer): hivemind builds this key
    as ``f"{prefix}_progress"`` with the optimizer's run id as prefix."""
    return f"{run_id}_progress"


def state_averager_prefix(run_id: str) -> str:
    """The prefix of ``hivemind.Optimizer``'s ``TrainingStateAverager`` (its matchmaking keys, its state
    download handlers): hivemind builds it as ``f"{run_id}_state_averager"``; the monitor's state keeper uses
    the same one so that it averages and serves state with the trainers."""
    return f"{run_id}_state_averager"


def fingerprints_key(state_prefix: str) -> str:
    """The signed fingerprints of the state that each holder serves (cotrain.hivemind_ext.statecheck), named
    from the state averager's prefix (``FingerprintSchema.fingerprints`` under prefix ``state_prefix``)."""
    return f"{state_prefix}_fingerprints"


def state_fingerprints_key(run_id: str) -> str:
    """``fingerprints_key`` of the run's state averager: ``{run_id}_state_averager_fingerprints``."""
    return fingerprints_key(state_averager_prefix(run_id))


def grad_averager_prefix(run_id: str) -> str:
    """The prefix of ``hivemind.Optimizer``'s gradient averager: hivemind builds it as
    ``f"{run_id}_grad_averager"``."""
    return f"{run_id}_grad_averager"


def outer_averager_prefix(run_id: str) -> str:
    """The prefix of the DiLoCo strategy's averager of pseudo-gradients (the parameters' change over a round):
    its matchmaking keys and all-reduce handlers."""
    return f"{run_id}_outer_averager"


def served_state_key(run_id: str) -> str:
    """The peers that offer the run's training state for download, each with its priority (its global step):
    hivemind's averager declares itself under ``f"{prefix}.all_averagers"``."""
    return f"{state_averager_prefix(run_id)}.all_averagers"


def voters_key(run_id: str) -> str:
    """A private swarm's voters: each signing key's proof that a token holder stands behind it
    (``VotersSchema.voters`` under prefix ``run_id``, cotrain.access.voters)."""
    return f"{run_id}_voters"


def revocations_key(run_id: str) -> str:
    """The private swarm's list of revoked access tokens, signed by its authority (cotrain.access)."""
    return f"{run_id}_access_revocations"
