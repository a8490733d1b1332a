"""The settings a loop of one's own gives ``SwarmPeer`` as keyword arguments, made into the run's and the
peer's configs (cotrain.config) that ``cotrain train`` resolves from its flags: one way to build a peer.

A setting goes by its config name. The run settings an API peer takes are ``API_RUN``'s (every peer of a run
must agree on them); ``max_grad_norm`` is this peer's clipping; any other name is a field of
``cotrain.config.PeerConfig``. ``API_PEER`` holds the API's defaults where they differ from ``cotrain
train``'s (a loop of one's own listens on every interface, waits less, keeps no NaN backup).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cotrain.config import PeerConfig, RunConfig
from cotrain.config.averaging import grad_compression_problems
from cotrain.config.run import TOPK_OUTER_STEP
from cotrain.errors import UserError
from cotrain.registry import DEFAULT_STRATEGY

__all__ = ["API_PEER", "API_RUN", "configs_of"]

# the run settings the API takes, with its defaults (None: the outer step's, which depend on the codec)
API_RUN: dict[str, Any] = {
    "run_id": None,
    "target_batch_size": None,
    "strategy": DEFAULT_STRATEGY,
    "local_steps": 50,
    "outer_lr": None,
    "outer_momentum": None,
    "outer_overlap": False,
    "outer_compression": "dense",
    "topk_density": 1 / 64,
    "topk_bits": 2,
    "topk_feedback_decay": 0.9,
    "aggregation": "mean",
    "clip_tau": "auto",
    "clip_iterations": 5,
    "aggregation_options": {},
    "outer_compression_options": {},
}
API_PEER: dict[str, Any] = {
    "initial_peers": [],
    "host_maddrs": ["/ip4/0.0.0.0/tcp/0"],
    "announce_maddrs": [],
    "client_mode": False,
    "identity_path": "",
    "matchmaking_time": 5.0,
    "averaging_timeout": 60.0,
    "grad_compression": "fp16",
    "load_state_timeout": 60.0,
    "statistics_expiration": 600.0,
    "startup_timeout": 20.0,
    "bandwidth": 0.0,
    "batch_size_lead": 0,
    "nat_port_map": False,
    "use_ipfs": False,
    "verbose": False,
    "backup_every_steps": 0,
}
TIMEOUTS = ("matchmaking_time", "averaging_timeout", "load_state_timeout")


def configs_of(
    settings: dict[str, Any], batch_size_per_step: int | None
) -> tuple[RunConfig, PeerConfig, float]:
    """(run, peer, max_grad_norm) from a ``SwarmPeer``'s keyword settings, every problem in one error."""
    settings = dict(settings)
    max_grad_norm = float(settings.pop("max_grad_norm", 0.0))
    run_settings = {name: settings.pop(name, default) for name, default in API_RUN.items()}
    if run_settings["run_id"] is None or run_settings["target_batch_size"] is None:
        raise UserError("run_id and target_batch_size are required (or config=(run, peer))")
    # the outer step: 0.7 with Nesterov 0.9 (dense rounds), 1 without momentum (topk), unless given
    step = TOPK_OUTER_STEP if run_settings["outer_compression"] == "topk" else {}
    for name in TOPK_OUTER_STEP:
        if run_settings[name] is None:
            run_settings[name] = step.get(name, getattr(RunConfig, name))
    run_settings["clip_tau"] = str(run_settings["clip_tau"])
    for name in ("aggregation_options", "outer_compression_options"):
        run_settings[name] = dict(run_settings[name] or {})
    peer_settings = {**API_PEER, **settings}
    for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
        peer_settings[name] = list(peer_settings[name])

    run = RunConfig(**run_settings)
    problems = [p for p in run.problems() if p.split()[0] in API_RUN]
    if batch_size_per_step is not None and batch_size_per_step <= 0:
        problems.append(f"batch_size_per_step must be positive, got {batch_size_per_step}")
    problems += grad_compression_problems(
        peer_settings["grad_compression"], peer_settings.get("grad_compression_options", {})
    )
    if any(peer_settings[name] <= 0 for name in TIMEOUTS):
        problems.append("matchmaking_time, averaging_timeout and load_state_timeout must be positive")
    known = {f.name for f in dataclasses.fields(PeerConfig)}
    for name in sorted(set(peer_settings) - known):
        problems.append(f"unknown setting {name!r} (see cotrain.config.PeerConfig)")
    if problems:
        raise UserError("; ".join(problems))
    return run, PeerConfig(**peer_settings), max_grad_norm
