"""The swarm's parts of the two strategies, built from a run's and a peer's settings (cotrain.config): the
sync optimizer (a trainer's, or an auxiliary reducer's), DiLoCo's auxiliary reducer, the aggregation, the
averagers' and the progress tracker's options."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from cotrain.config import PeerConfig, RunConfig


def sync_optimizer(
    dht: Any,
    run: RunConfig,
    peer: PeerConfig,
    params: Iterable,
    optimizer: Callable,
    scheduler: Callable | None,
    batch_size_per_step: int | None,
    auxiliary: bool = False,
) -> Any:
    """The sync strategy's SwarmOptimizer for these settings (``auxiliary``: an auxiliary reducer's, which
    accumulates nothing and steps nothing)."""
    from cotrain.swarm.averaging import gradient_averager_factory
    from cotrain.swarm.optimizer import (
        LOAD_STATE_COMPRESSION,
        SwarmOptimizer,
        gradient_compression,
        state_compression,
        tracker_options,
    )

    averager_opts = averager_options(peer)
    run_id, target_batch_size = run.run_id, run.target_batch_size
    return SwarmOptimizer(
        dht=dht,
        # hivemind keeps client_mode=None (read as "not a client") unless a value is given, and then uses
        # the DHT's: a client would try to serve its state and fail at its first global step
        client_mode=dht.client_mode,
        auxiliary=auxiliary,
        run_id=run_id,
        params=list(params),
        optimizer=optimizer,
        scheduler=scheduler,
        target_batch_size=max(1, target_batch_size - peer.batch_size_lead),
        batch_size_per_step=batch_size_per_step,
        matchmaking_time=peer.matchmaking_time,
        averaging_timeout=peer.averaging_timeout,
        load_state_timeout=peer.load_state_timeout,
        grad_compression=gradient_compression(peer.grad_compression),
        state_averaging_compression=state_compression(peer.grad_compression),
        load_state_compression=LOAD_STATE_COMPRESSION,
        average_state_every=1,
        offload_optimizer=peer.offload_optimizer,
        delay_optimizer_step=peer.delay_optimizer_step or peer.delay_grad_averaging,
        delay_grad_averaging=peer.delay_grad_averaging,
        delay_state_averaging=peer.delay_state_averaging,
        averager_opts=averager_opts,
        # hivemind gives averager_opts to the state averager only; the gradient averager gets them here
        grad_averager_factory=gradient_averager_factory(dict(averager_opts, aggregation=aggregation_of(run))),
        robust_progress=aggregation_of(run).robust,
        tracker_opts=tracker_options(peer.matchmaking_time, tracker_settings(peer)),
        performance_ema_alpha=peer.performance_ema_alpha,
        verbose=peer.verbose,
    )


def diloco_reducer(dht: Any, run: RunConfig, peer: PeerConfig, model: torch.nn.Module) -> Any:
    """DiLoCoStrategy.reducer: the run's round averager for ``model``'s parameters, in auxiliary mode, and a
    tracker of the run's rounds (cotrain.swarm.auxiliary.RoundReducer)."""
    from cotrain.optim import parameter_groups
    from cotrain.swarm.auxiliary import RoundReducer
    from cotrain.swarm.lineage import round_averager
    from cotrain.swarm.optimizer import gradient_compression, tracker_options
    from cotrain.swarm.progress import tracker_class
    from cotrain.swarm.sparse import codec_of

    averager_opts = averager_options(peer)
    request_timeout = averager_opts.pop("request_timeout")
    aggregation = aggregation_of(run)
    averager = round_averager(
        [p for group in parameter_groups(model, run.weight_decay) for p in group["params"]],
        dht,
        run_id=run.run_id,
        codec=codec_of(run.outer_compression, run.topk_density, run.topk_bits, run.topk_feedback_decay),
        compression=gradient_compression(peer.grad_compression),
        aggregation=aggregation,
        matchmaking_time=peer.matchmaking_time,
        request_timeout=request_timeout,
        averaging_timeout=peer.averaging_timeout,
        averager_opts=averager_opts,
        auxiliary=True,
        momentum=run.outer_momentum > 0,
    )
    tracker = tracker_class(aggregation.robust)(
        dht=dht,
        prefix=run.run_id,
        target_batch_size=max(1, run.local_steps * run.target_batch_size - peer.batch_size_lead),
        client_mode=False,
        status_loglevel=logging.INFO if peer.verbose else logging.DEBUG,
        follows_clients=True,
        start=True,
        **tracker_options(peer.matchmaking_time, tracker_settings(peer)),
    )
    return RoundReducer(averager, tracker, peer.matchmaking_time, peer.averaging_timeout)


def aggregation_of(run: RunConfig) -> Any:
    """The aggregation part (cotrain.swarm.aggregation) that a RunConfig names, with its settings."""
    from cotrain.swarm.aggregation import build, parse_tau

    return build(run.aggregation, parse_tau(run.clip_tau), run.clip_iterations)


def averager_options(peer: PeerConfig) -> dict:
    """The peer's averager settings: group size, request timeout, the direct all-reduce path, bandwidth (when
    given)."""
    from cotrain.swarm.optimizer import request_timeout

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
