"""A trainer of several ranks (cotrain.engine.node): how many, on which devices, rank 0's set-up beside the
trainer, and the role of every other rank (``RankFollower``)."""

from __future__ import annotations

import copy
import logging
import os
import threading

import torch
import torch.distributed as dist

from cotrain.config import Config
from cotrain.config.resolve import node_problems
from cotrain.data import ExampleStream
from cotrain.engine import batches
from cotrain.engine.node import Node, NodeError, check_shardable
from cotrain.errors import UserError
from cotrain.host.hardware import Precision, resolve_devices
from cotrain.host.ranks import Ranks, init_ranks, leave_ranks, rank_env
from cotrain.models import (
    check_positions,
    collator_for_run,
    enable_gradient_checkpointing,
    forward_loss,
    model_for_tokenizer,
)
from cotrain.optim import optimizer_factory, parameter_groups
from cotrain.registry import strategy_class

logger = logging.getLogger(__name__)

SEED_STRIDE = 7919  # rank r of a peer reads its data in the order of seed + r * SEED_STRIDE


def node_world(config: Config) -> int:
    """How many ranks this trainer has: torchrun's world size, --nproc-per-node, or (0: auto) one per GPU
    that --devices lists when the strategy is DiLoCo (sync keeps DataParallel over them); 1: no node."""
    env = rank_env()
    if env is not None:
        return env[1]
    peer = config.peer
    if peer.nproc_per_node:
        return peer.nproc_per_node
    devices = resolve_devices(peer.devices)
    return len(devices) if len(devices) > 1 and strategy_class(config.run.strategy).ranks_over_devices else 1


def rank_device(config: Config, world: int, local_rank: int) -> torch.device:
    """The device of this rank: the local_rank-th GPU of --devices, or the CPU for every rank."""
    devices = resolve_devices(config.peer.devices)
    if devices[0].type == "cpu":
        return devices[0]
    if rank_env() is not None and len(devices) == 1 and not config.peer.devices.strip():
        return torch.device("cuda", local_rank)  # torchrun: one GPU per local rank
    if len(devices) != world:
        raise UserError(
            f"--nproc-per-node {world} needs one GPU per rank: --devices lists {len(devices)} "
            f"({config.peer.devices or 'the first GPU'})"
        )
    return devices[local_rank]


def check_node(config: Config, world: int) -> None:
    """The settings a node refuses, before any rank starts (where --nproc-per-node did not name the node
    already, the config's own check did not see them)."""
    problems = node_problems(config, world)
    if problems:
        raise UserError(problems[0])


def start_node(config: Config, world: int, model: torch.nn.Module, stop: threading.Event, manifest: str):
    """Rank 0's side: launch the other ranks (unless torchrun did), join the process group, hand them the
    resolved config, and shard a copy of ``model`` (which stays on the host as the swarm's replica).
    Returns (node, launched ranks or None)."""
    check_node(config, world)
    check_shardable(model, world)
    device = rank_device(config, world, 0)
    cores = os.cpu_count() or 1
    if rank_env() is None and device.type == "cpu" and world > cores:
        raise UserError(
            f"--nproc-per-node {world} on the CPU: this machine has {cores} cores; give at most {cores}"
        )
    ranks = Ranks(config, world, stop) if rank_env() is None else None
    try:
        init_ranks(device)
        dist.broadcast_object_list([config, manifest], src=0)
        node = Node(copy.deepcopy(model), _groups(config), optimizer_factory(config.run), device)
    except BaseException:
        if ranks is not None:
            ranks.stopping()
            ranks.close(timeout=1.0)
        leave_ranks()
        raise
    if ranks is not None:
        node.on_failure = ranks.failed_rank
    logger.info(f"This peer trains on {world} ranks ({device.type}), the model sharded with FSDP2")
    return node, ranks


def stop_node(node: Node | None, ranks: Ranks | None) -> None:
    """Rank 0, at the end: tell the ranks to stop, leave the process group, reap the launched ranks."""
    if ranks is not None:
        ranks.stopping()
    if node is not None:
        node.stop()
    leave_ranks()
    if ranks is not None:
        ranks.close()


def _groups(config: Config):
    return lambda model: parameter_groups(model, config.run.weight_decay)


class RankFollower:
    """A rank other than 0: its shard of the model and its own micro-batches, at rank 0's commands."""

    def __init__(self, config: Config, stop: threading.Event) -> None:
        self.config, self.stop = config, stop

    def run(self) -> int:
        rank, world, local_rank = rank_env()
        init_ranks(rank_device(self.config, world, local_rank))
        received: list = [None, None]
        try:
            dist.broadcast_object_list(received, src=0)  # rank 0's config, after it joined the swarm
        except (RuntimeError, dist.DistError):
            logger.debug("rank 0 of this peer stopped before it started")
            return 1
        config, manifest = received
        run, peer = config.run, config.peer
        if peer.torch_threads:
            torch.set_num_threads(peer.torch_threads)
        device = rank_device(config, world, local_rank)

        seed = peer.seed + SEED_STRIDE * rank
        data = ExampleStream(
            peer.dataset_url or peer.dataset_path,
            seed=seed,
            cache_dir=peer.cache_dir or None,
            expected_manifest=manifest,
        )
        model = model_for_tokenizer(run, data.tokenizer)
        check_positions(model, run.max_seq_length)
        model.train()
        if peer.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        node = Node(model, _groups(config), optimizer_factory(run), device)
        collator = collator_for_run(run, data.tokenizer, seed=seed)
        stream = batches(data, peer.per_device_train_batch_size, collator, seed)
        precision = Precision(device, bf16=peer.bf16)
        try:
            node.follow(stream, peer.gradient_accumulation_steps, precision, forward_loss)
        except NodeError as e:  # rank 0 reports the peer's end; this rank ends quietly
            logger.debug(str(e))
            return 1
        return 0

    def close(self) -> None:
        leave_ranks()
