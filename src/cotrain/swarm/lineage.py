"""DiLoCo's lineages and the round's all-reduce (cotrain.swarm.diloco).

Peers that diverged (a round alone, another group, a fresh download) must step from the same outer state
again. Each peer keeps a *lineage*: a digest that all members of a group derive alike from the group's
members and their previous lineages after averaging together, and that a round alone or a download replaces
with a fresh random one. Peers of the same lineage hold the same global parameters and momentum (up to the
rounding of the compressed averages), so their all-reduce carries the pseudo-gradients alone; when a group's
lineages differ, and every ``OUTER_STATE_EVERY`` rounds (against the slow drift of that rounding), the same
all-reduce also averages the outer state. The choice is made in the all-reduce itself from what the members
sent at matchmaking (hivemind's gathered data), so all members of a group make the same one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import hivemind
import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils.asyncio import enter_asynchronously

from cotrain.swarm.aggregation import Aggregation, Mean
from cotrain.swarm.internals.hosting import ServedInThread
from cotrain.swarm.liveness import WatchedRounds
from cotrain.swarm.robust import RobustAveraging

logger = logging.getLogger(__name__)

OUTER_STATE_EVERY = 10  # rounds: the outer state rides along at least this often (see the module's doc)


def fresh_lineage() -> bytes:
    """The lineage of a peer whose outer state no other peer is known to share (a start, a round alone, a
    download)."""
    return os.urandom(8)


def carries_outer_state(gathered: Iterable[Any], periodic: bool = True) -> bool:
    """Whether a group's all-reduce also averages the outer state: when its members' lineages differ (or one
    is missing), and (``periodic``: rounds whose averages reach each member with its own rounding) at every
    ``OUTER_STATE_EVERY``-th round. ``gathered``: what each member sent at matchmaking (``{"lineage": bytes,
    "round": int}``)."""
    lineages, rounds = set(), set()
    for item in gathered:
        if not isinstance(item, dict) or not isinstance(item.get("lineage"), bytes):
            return True
        lineages.add(item["lineage"])
        rounds.add(item.get("round"))
    if len(lineages) != 1:
        return True
    return periodic and any(not isinstance(r, int) or r % OUTER_STATE_EVERY == 0 for r in rounds)


def next_lineage(round_: int, gathered: dict[Any, Any]) -> bytes:
    """The lineage every member of a group that averaged in round ``round_`` takes: a digest of the round, the
    members and their lineages, the same on each of them (``gathered``: member's peer id -> what it sent)."""
    digest = hashlib.blake2b(str(int(round_)).encode(), digest_size=8)
    for peer_id in sorted(gathered, key=lambda p: p.to_bytes()):
        item = gathered[peer_id]
        lineage = item.get("lineage") if isinstance(item, dict) else None
        digest.update(peer_id.to_bytes())
        digest.update(lineage if isinstance(lineage, bytes) else b"?")
    return digest.digest()


class OuterAverager(ServedInThread, RobustAveraging, WatchedRounds):
    """The round's all-reduce: its first ``changes`` tensors (the pseudo-gradients) always, the rest (the
    outer state) only where ``carries_outer_state`` says so for the group, decided from the group's gathered
    data so that all members decide alike. Returns (the gathered data: member's peer id -> what it sent,
    whether the all-reduce was partial here: a member's contribution dropped or a part left un-averaged,
    after which this peer cannot count on holding the group's outer state)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        dht: hivemind.DHT,
        *,
        changes: int,
        aggregation: Aggregation = Mean(),
        periodic_state: bool = True,
        records: Any = None,
        **kwargs,
    ):
        self.changes, self.aggregation, self.periodic_state = changes, aggregation, periodic_state
        self.records = records  # (codec per tensor, feedback buffer) where tensors travel as records
        super().__init__(tensors, dht, **kwargs)

    async def aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        try:
            loaded = map(self.serializer.loads, group_info.gathered)
            bandwidths, mode_ids, user_bytes = zip(*loaded, strict=True)
            gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_bytes), strict=True))
            download = [
                0.0 if AveragingMode(mode) == AveragingMode.CLIENT else bandwidth
                for bandwidth, mode in zip(bandwidths, mode_ids, strict=True)
            ]
            infos = kwargs.pop("tensor_infos", None)
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                full = carries_outer_state(gathered.values(), self.periodic_state)
                count = len(local_tensors) if full else self.changes
                tensors = list(local_tensors[:count])
                fractions = await asyncio.get_event_loop().run_in_executor(
                    None, load_balance_peers, sum(t.numel() for t in tensors), download, min_vector_size
                )
                await self.run_allreduce(
                    tensors,
                    group_info,
                    peer_fractions=fractions,
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
