"""DiLoCo's round averager: one all-reduce that carries the pseudo-gradients always and the outer state only
where the group's lineages say so (cotrain.algorithms.lineage), decided from the group's gathered data so
that all members decide alike. The run's trainers and its auxiliary reducers build it alike
(``round_averager``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import hivemind
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    RoleAdaptiveCompression,
    TensorRole,
)
from hivemind.utils import enter_asynchronously, get_dht_time

from cotrain.algorithms.aggregation import Aggregation, Mean
from cotrain.algorithms.lineage import carries_outer_state
from cotrain.algorithms.sparse import Raw, TopK
from cotrain.hivemind_ext import install
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.liveness import WatchedRounds
from cotrain.hivemind_ext.reducers import RobustAveraging
from cotrain.hivemind_ext.roundresults import ServesRoundResults
from cotrain.keys import outer_averager_prefix

logger = logging.getLogger(__name__)


class OuterAverager(ServedInThread, RobustAveraging, ServesRoundResults, WatchedRounds):
    """The round's all-reduce: its first ``changes`` tensors (the pseudo-gradients) always, the rest (the
    outer state) only where ``carries_outer_state`` says so for the group, decided from the group's gathered
    data so that all members decide alike. Returns (the gathered data: member's peer id -> what it sent,
    whether the all-reduce was partial here: a member's contribution dropped or a part left un-averaged,
    after which this peer cannot count on holding the group's outer state). A round's result (its averaged
    changes) is kept and served to a peer that missed the round (cotrain.hivemind_ext.roundresults)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        *,
        changes: int,
        aggregation: Aggregation = Mean(),
        periodic_state: bool = True,
        records: Any = None,
        state_lock: Any = None,
        **kwargs,
    ):
        self.changes, self.aggregation, self.periodic_state = changes, aggregation, periodic_state
        self.records = records  # (codec per tensor, feedback buffer) where tensors travel as records
        self.feedback = None if records is None else records[1]
        self.state_bytes = 4  # bytes per value of the outer state on the wire (round_averager sets it)
        self.momentum = True  # whether the outer state holds momentum buffers (round_averager sets it)
        # held while a round averages the outer state in place (set before a serving process is forked)
        self.state_lock = state_lock
        super().__init__(tensors, dht, **kwargs)

    @property
    def result_tensors(self) -> int:
        return self.changes

    def expect_group(self, members: int | None) -> None:
        """Assemble the next matchmaking's group as soon as it holds ``members`` peers (at most the configured
        target group size; None: that target), not at its leader's expiration (``round_expiration``): a round
        waits for no one once everyone is in, and for everyone until then."""
        target = self.matchmaking_kwargs["target_group_size"]
        if members is not None:
            target = max(2, members) if target is None else min(target, max(2, members))
        matchmaking = getattr(self, "_matchmaking", None)  # set once the averager's loop runs
        if matchmaking is not None:
            matchmaking.target_group_size = target

    async def aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        try:
            loaded = map(self.serializer.loads, group_info.gathered)
            bandwidths, mode_ids, user_bytes = zip(*loaded, strict=True)
            # the members that send: an auxiliary reducer (cotrain.hivemind_ext.auxiliary) adds no
            # contribution, no lineage and no round of its own
            gathered = {
                peer: self.serializer.loads(data)
                for peer, mode, data in zip(group_info.peer_ids, mode_ids, user_bytes, strict=True)
                if AveragingMode(mode) != AveragingMode.AUX
            }
            download = [
                0.0 if AveragingMode(mode) == AveragingMode.CLIENT else bandwidth
                for bandwidth, mode in zip(bandwidths, mode_ids, strict=True)
            ]
            infos = kwargs.pop("tensor_infos", None)
            full = carries_outer_state(gathered, self.periodic_state)
            in_place = self.state_lock if full and self.state_lock is not None else contextlib.nullcontext()
            async with (
                enter_asynchronously(self.get_tensors()) as local_tensors,
                enter_asynchronously(in_place),
            ):
                count = len(local_tensors) if full else self.changes
                tensors = list(local_tensors[:count])
                fractions = await asyncio.get_event_loop().run_in_executor(
                    None, load_balance_peers, sum(t.numel() for t in tensors), download, min_vector_size
                )
                await self.run_allreduce(
                    tensors,
                    group_info,
                    peer_fractions=fractions,
                    modes=tuple(map(AveragingMode, mode_ids)),
                    tensor_infos=None if infos is None else list(infos[:count]),
                    **kwargs,
                )
            runner = self.running_groups[group_info.group_id].result()
            partial = bool(runner.banned_senders) or runner.tensor_part_container.failed_size > 0
            partial = partial or getattr(runner, "bounded_by", 0.0) > 0  # a result bounded here
            return gathered, partial
        except BaseException as e:
            if isinstance(e, Exception):
                logger.exception(e)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e


def round_expiration(eta: float, matchmaking_time: float, averaging_timeout: float) -> float:
    """When a round's group is assembled with whoever joined it (hivemind's matchmaking ``scheduled_time``),
    for a peer that expects the round to end at ``eta`` (DHT time): a matchmaking time after that end (or
    after now, if later). Every peer of the round, its auxiliary reducers too, looks for the group this way:
    the earliest of them leads it, and the peers whose last inner step ends late (a slow peer, a loaded host)
    still find it open. A group that holds every peer expected closes at once (``expect_group``); before, a
    leader's group closed ``matchmaking_time`` after it declared itself, and the peers that came later formed
    groups of their own (measured: 16 peers in groups of 2 to 12). At most half the ``averaging_timeout``
    away, which the all-reduce needs the rest of."""
    now = get_dht_time()
    return min(max(eta, now) + matchmaking_time, now + averaging_timeout / 2)


def round_averager(
    parameters: Sequence[torch.Tensor],
    dht: hivemind.DHT,
    *,
    run_id: str,
    codec: TopK | None,
    compression: CompressionBase,
    aggregation: Aggregation,
    matchmaking_time: float,
    request_timeout: float,
    averaging_timeout: float,
    averager_opts: dict,
    client_mode: bool = False,
    auxiliary: bool = False,
    momentum: bool = True,
    state: Sequence[torch.Tensor] | None = None,
    state_lock: Any = None,
) -> OuterAverager:
    """The averager of a DiLoCo run's rounds for ``parameters`` (their shapes and types; its buffers are in
    host memory), as the run's trainers and its auxiliary reducers build it alike (the all-reduce cuts every
    member's tensors into the same parts): the changes, the global parameters, the outer momentum (unless
    ``momentum`` is False: a run whose outer step keeps none); with a ``codec``, as records: the changes'
    top-k records, the global parameters' and momentum's float32 bytes (sparse.Raw), and a feedback buffer
    (``.feedback``) for what this peer did not send and, as a reducer, what the averages' records left
    out.

    ``state`` (dense rounds): the outer state's own tensors, in shared memory, averaged in place where a
    round carries it (under ``state_lock``, the lock of whatever else reads them) instead of in buffers of
    their own: 8 bytes per parameter less (4 without momentum)."""
    install()  # hivemind's corrections (fixes), also where no optimizer or state keeper is built first
    numel = sum(p.numel() for p in parameters)
    opts = dict(averager_opts)
    kinds = 2 if momentum else 1  # the outer state: the global parameters, and the momentum if any
    with torch.no_grad():
        if codec is None:
            buffers = [torch.zeros_like(p, device="cpu").share_memory_() for p in parameters]
            if state is None:
                state = [torch.zeros_like(p, device="cpu").share_memory_() for p in [*parameters] * kinds]
            if len(state) != kinds * len(parameters) or not all(t.is_shared() for t in state):
                raise ValueError("the outer state's tensors: shared, one per parameter and kind")
            buffers += state
            changes = len(parameters)
        else:
            sizes = [codec.encoded_size(numel), *[Raw().encoded_size(numel)] * kinds]
            buffers = [torch.zeros(size, dtype=torch.uint8).share_memory_() for size in sizes]
            changes = 1
            opts["records"] = ([codec, *[Raw()] * kinds], torch.zeros(numel).share_memory_())
            opts["part_size_bytes"] = codec.record * (DEFAULT_PART_SIZE_BYTES // codec.record)
    # a dead group member is given up on after next_chunk_timeout as a sender, twice that as a reducer (its
    # parts then stay un-averaged), within the round's averaging_timeout. A live reducer's first results come
    # only once every sender's part reached it: on a saturated link nearly the whole transfer, so the
    # reducer's limit (2/3 of averaging_timeout) must exceed it, or a slow round ends partial for a peer
    # (measured at 10 Mbit/s with a limit of half the timeout: 185 s against 192 s)
    chunk_timeout = max(5.0, averaging_timeout / 3)
    # the changes go as --grad-compression says; the outer state at least in fp16 (never 8-bit: its average
    # must stay where the peers already agree)
    n = (len(buffers) - changes) // kinds
    roles = [TensorRole.GRADIENT] * changes + [TensorRole.PARAMETER] * n
    roles += [TensorRole.OPTIMIZER] * (len(buffers) - len(roles))
    outer_state = NoCompression() if isinstance(compression, NoCompression) else Float16Compression()
    if codec is not None:  # records travel as they are
        compression = outer_state = NoCompression()
    averager = OuterAverager(
        buffers,
        dht,
        changes=changes,
        periodic_state=codec is None,
        state_lock=state_lock if codec is None else None,
        aggregation=aggregation,
        prefix=outer_averager_prefix(run_id),
        min_matchmaking_time=matchmaking_time,
        request_timeout=request_timeout,
        allreduce_timeout=averaging_timeout,
        next_chunk_timeout=chunk_timeout,
        compression=RoleAdaptiveCompression(
            gradient=compression, parameter=outer_state, optimizer=outer_state, default=compression
        ),
        tensor_infos=[
            CompressionInfo.from_tensor(t, key=i, role=role)
            for i, (t, role) in enumerate(zip(buffers, roles, strict=True))
        ],
        client_mode=client_mode,
        auxiliary=auxiliary,
        start=True,
        **opts,
    )
    averager.state_bytes = 4 if isinstance(outer_state, NoCompression) else 2
    averager.momentum = momentum
    return averager
