"""What both strategies build from a run's and a peer's settings (cotrain.config): the aggregation, the
compression of what a peer sends, the codec of a round, the averagers' and the progress tracker's
options."""

from __future__ import annotations

from typing import Any

from cotrain.algorithms.aggregation import build, parse_tau
from cotrain.config import PeerConfig, RunConfig
from cotrain.hivemind_ext.optimizer import gradient_compression, request_timeout
from cotrain.registry import codec


def aggregation_of(run: RunConfig) -> Any:
    """The aggregation part (cotrain.algorithms.aggregation) that a RunConfig names, with its settings and
    the values of its parameters (``aggregation_options``)."""

    return build(run.aggregation, parse_tau(run.clip_tau), run.clip_iterations, **run.aggregation_options)


def grad_compression_of(peer: PeerConfig) -> Any:
    """The hivemind compression that the peer's --grad-compression codec builds, with its options."""
    return gradient_compression(peer.grad_compression, peer.grad_compression_options)


def averager_options(peer: PeerConfig) -> dict:
    """The peer's averager settings: group size, request timeout, the direct all-reduce path, bandwidth (when
    given)."""

    options: dict = {
        "target_group_size": peer.target_group_size,
        "request_timeout": request_timeout(peer.matchmaking_time),
        "direct": peer.direct_allreduce,
    }
    if peer.bandwidth > 0:
        options["bandwidth"] = peer.bandwidth
    return options


def tracker_settings(peer: PeerConfig) -> dict:
    return {
        "min_refresh_period": peer.min_refresh_period,
        "max_refresh_period": peer.max_refresh_period,
        "default_refresh_period": peer.default_refresh_period,
        "expected_drift_peers": peer.expected_drift_peers,
        "expected_drift_rate": peer.expected_drift_rate,
        "metadata_expiration": peer.metadata_expiration,
    }


def round_codec(run: RunConfig) -> Any:
    """What encodes DiLoCo's rounds: the records codec a RunConfig names, built with its parameters (topk's
    from their own fields, the others from ``outer_compression_options``); None for dense rounds."""
    if run.outer_compression == "dense":
        return None
    records = codec(run.outer_compression)
    what = f"outer_compression {run.outer_compression}"
    return records.build(**records.settings(run.outer_compression_options, run, what))
