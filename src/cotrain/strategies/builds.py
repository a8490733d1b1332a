"""What both strategies build from a run's and a peer's settings (cotrain.config): the aggregation, the
codec of a round, the averagers' and the progress tracker's options."""

from __future__ import annotations

from typing import Any

from cotrain.algorithms.aggregation import build, parse_tau
from cotrain.algorithms.sparse import codec_of
from cotrain.config import PeerConfig, RunConfig
from cotrain.hivemind_ext.optimizer import request_timeout


def aggregation_of(run: RunConfig) -> Any:
    """The aggregation part (cotrain.algorithms.aggregation) that a RunConfig names, with its settings."""

    return build(run.aggregation, parse_tau(run.clip_tau), run.clip_iterations)


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
    """The codec of DiLoCo's rounds that a RunConfig names (None: dense)."""
    return codec_of(run.outer_compression, run.topk_density, run.topk_bits, run.topk_feedback_decay)
