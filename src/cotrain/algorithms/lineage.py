"""DiLoCo's lineages and the round's all-reduce (cotrain.strategies.diloco_rounds).

Peers that diverged (a round alone, another group, a fresh download) must step from the same outer state
again. Each peer keeps a *lineage*: a digest that all members of a group derive alike from the group's
members and their previous lineages after averaging together, that a round alone replaces with a fresh random
one, and that a download takes from its donor where the donor vouches for the state it served (else a fresh
one: cotrain.strategies.diloco_rounds). A peer starts with the digest of its initial global parameters' exact
bytes (``initial_lineage``; the outer momentum is zero then): peers that start from the same weights, as a
preset's seeded initialization gives them, share their first round's lineage. Peers of the same lineage
hold the same global parameters and momentum (up to the rounding of the compressed averages), so their
all-reduce carries the pseudo-gradients alone; when a group's lineages differ, and every
``OUTER_STATE_EVERY``-th round (rounds 9, 19, ...: against the slow drift of that rounding, which the first
rounds have not had time for), the same all-reduce also averages the outer state. The choice is made in the
all-reduce itself from what the members sent at matchmaking (hivemind's gathered data), so all members of a
group make the same one.

A member that shows a fresh lineage every round would make every round of its groups carry the outer state:
in sparse rounds, float32 state 200-400 times the records' bytes, for the whole group. So each peer watches
the others (``LineageWatch``): a member of a round that was whole here should show, in its next round, the
lineage that round gave the group; one that shows another in ``LINEAGE_BREAKS`` of the last ``LINEAGE_WINDOW``
rounds this peer expected it in is *struck* by this peer, with one log line. Honest peers break their
lineage only when their own side of a round failed (a round alone, a partial all-reduce, a non-finite
average) or they downloaded the state. At matchmaking every member sends the peers it strikes, and a group
leaves out of its choice the lineage of each member that a strict majority of the other members strike
(``discounted``): again the same choice on every member. A struck peer still averages its changes; of the
rounds it is watched in, at most ``LINEAGE_BREAKS`` in ``LINEAGE_WINDOW`` carry the outer state for its sake
(a break is noted when its round ends, so the one that strikes it has carried the state). A peer that
changes groups every round is not watched (nobody expects it), and in a pair one member's word decides: a
liar paired with a diverged honest peer can keep their round from carrying the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
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
from hivemind.utils.asyncio import enter_asynchronously

from cotrain.algorithms.aggregation import Aggregation, Mean
from cotrain.algorithms.fingerprint import sampled_values
from cotrain.algorithms.sparse import Raw, TopK
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.liveness import WatchedRounds
from cotrain.hivemind_ext.reducers import RobustAveraging
from cotrain.keys import outer_averager_prefix

logger = logging.getLogger(__name__)

LINEAGE_BYTES = 8  # a lineage's length
OUTER_STATE_EVERY = 10  # rounds: the outer state rides along at least this often (see the module's doc)
ROUND_BITS = 8  # low bits of the round in the matchmaking key: peers average only with peers of their round
LINEAGE_BREAKS = 2  # rounds, among a peer's last LINEAGE_WINDOW watched ones, with another lineage: struck
LINEAGE_WINDOW = 20
MAX_STRUCK = 32  # peers one member names as struck in what it sends at matchmaking (the rest are ignored)


def fresh_lineage() -> bytes:
    """The lineage of a peer whose outer state no other peer is known to share (a start, a round alone, a
    download)."""
    return os.urandom(LINEAGE_BYTES)


def initial_lineage(global_parameters: Iterable[torch.Tensor]) -> bytes:
    """The lineage of a peer before its first outer step: a digest of its global parameters (shapes and exact
    bytes), so that peers that start from the same weights share it (see the module's doc)."""
    digest = hashlib.blake2b(digest_size=LINEAGE_BYTES, person=b"cotrain-start")
    for tensor in global_parameters:
        flat = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(flat.shape)}{flat.dtype}".encode())
        digest.update(flat.reshape(-1).view(torch.uint8).numpy())
    return digest.digest()


def periodic_round(round_: Any) -> bool:
    """Whether a dense round carries the outer state whatever the lineages (see the module's doc)."""
    return not isinstance(round_, int) or round_ % OUTER_STATE_EVERY == OUTER_STATE_EVERY - 1


def carries_outer_state(gathered: Mapping[Any, Any] | Iterable[Any], periodic: bool = True) -> bool:
    """Whether a group's all-reduce also averages the outer state: when its members' lineages differ (or one
    is missing), and (``periodic``: rounds whose averages reach each member with its own rounding) at every
    ``OUTER_STATE_EVERY``-th round. ``gathered``: what each member sent at matchmaking (``{"lineage": bytes,
    "round": int, "struck": [peer id bytes]}``), by member (a mapping: the members that most others strike do
    not count, ``discounted``) or not."""
    if isinstance(gathered, Mapping):
        skip = discounted(gathered)
        gathered = [item for peer, item in gathered.items() if peer not in skip]
    lineages, rounds = set(), set()
    for item in gathered:
        if not isinstance(item, dict) or not isinstance(item.get("lineage"), bytes):
            return True
        lineages.add(item["lineage"])
        rounds.add(item.get("round"))
    if len(lineages) > 1:
        return True
    return periodic and any(periodic_round(r) for r in rounds)


def _peer_bytes(peer: Any) -> Any:
    return peer.to_bytes() if hasattr(peer, "to_bytes") else peer


def discounted(gathered: Mapping[Any, Any]) -> set:
    """The members of a group (``gathered``: member -> what it sent at matchmaking) whose lineage does not
    count in ``carries_outer_state``: those that a strict majority of the other members name as struck
    (``"struck"``: peer ids as bytes, at most ``MAX_STRUCK`` read; see the module's doc)."""
    votes = dict.fromkeys(gathered, 0)
    names = {peer: _peer_bytes(peer) for peer in gathered}
    for voter, item in gathered.items():
        struck = item.get("struck") if isinstance(item, dict) else None
        if not isinstance(struck, list | tuple):
            continue
        named = {name for name in struck[:MAX_STRUCK] if isinstance(name, bytes)}
        for peer, name in names.items():
            if peer != voter and name in named:
                votes[peer] += 1
    others = len(gathered) - 1
    return {peer for peer, count in votes.items() if 2 * count > others}


class LineageWatch:
    """Which other peers this peer strikes for showing, round after round, a lineage other than the one their
    last round with it gave them (see the module's doc). Holds the lineage it expects of each member of its
    last whole round, and the outcomes of each peer's last ``window`` watched rounds where one was a break."""

    def __init__(self, breaks: int = LINEAGE_BREAKS, window: int = LINEAGE_WINDOW) -> None:
        self.breaks, self.window = breaks, window
        self.expected: dict[Any, tuple[int, bytes]] = {}  # peer -> (round, lineage) it should show then
        self.history: dict[Any, deque[bool]] = {}  # peer -> its last watched rounds (True: a break)

    def observe(self, me: Any, round_: int, gathered: Mapping[Any, Any], lineage: bytes | None) -> list:
        """After this peer's (``me``) all-reduce of round ``round_`` with the group that sent ``gathered``:
        note whether each member it expected in this round showed the lineage expected, then expect every
        other member to show ``lineage`` (the group's next one; None after a round that was partial here) in
        the next round. Returns the members struck from this round on."""
        newly = []
        for peer, item in gathered.items():
            expected = self.expected.get(peer)
            if peer == me or expected is None or expected[0] != round_:
                continue
            shown = item.get("lineage") if isinstance(item, dict) else None
            was = self.strikes(peer)
            history = self.history.setdefault(peer, deque(maxlen=self.window))
            history.append(shown != expected[1])
            if not any(history):  # only a break is worth remembering
                del self.history[peer]
            if not was and self.strikes(peer):
                newly.append(peer)
        self.expected = {peer: e for peer, e in self.expected.items() if e[0] > round_}
        if lineage is not None:
            self.expected.update({peer: (round_ + 1, lineage) for peer in gathered if peer != me})
        return newly

    def strikes(self, peer: Any) -> bool:
        """Whether this peer strikes ``peer`` now."""
        return sum(self.history.get(peer, ())) >= self.breaks

    def struck(self) -> list:
        """The peers this peer strikes, as bytes (what it sends at matchmaking), at most ``MAX_STRUCK``."""
        return [_peer_bytes(peer) for peer in self.history if self.strikes(peer)][:MAX_STRUCK]


def round_bits(round_: int) -> str:
    """The group bits of a round's matchmaking key (its ROUND_BITS low bits)."""
    return format(int(round_) % 2**ROUND_BITS, f"0{ROUND_BITS}b")


def next_lineage(round_: int, gathered: dict[Any, Any]) -> bytes:
    """The lineage every member of a group that averaged in round ``round_`` takes: a digest of the round, the
    members and their lineages, the same on each of them (``gathered``: member's peer id -> what it sent)."""
    digest = hashlib.blake2b(str(int(round_)).encode(), digest_size=LINEAGE_BYTES)
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


class Voucher:
    """The lineage a DiLoCo peer serves with its state. The peer vouches for its global parameters as they are
    after a round's outer step, a download or a resume: a newcomer that downloads them in that round takes
    the peer's lineage too, so that its first round with the group need not carry the outer state. Kept with
    their sampled values (cotrain.algorithms.fingerprint): a served state whose values differ (an outside
    write since) is served without a lineage, as is one of another round."""

    def __init__(self, parameters: int) -> None:
        self.parameters = parameters  # how many global parameters lead a served state's tensors
        self.vouched: tuple[int, bytes, torch.Tensor] | None = None

    def vouch(self, epoch: int, lineage: bytes, global_parameters: Sequence[torch.Tensor]) -> None:
        """Vouch for ``global_parameters`` at round ``epoch`` (the caller holds the state's lock)."""
        self.vouched = (epoch, lineage, sampled_values(global_parameters, epoch))

    def withdraw(self) -> None:
        self.vouched = None

    def served(self, epoch: Any, tensors: list[torch.Tensor]) -> bytes | None:
        """The lineage to serve with a state of round ``epoch`` whose first tensors are the global parameters
        (the caller holds the state's lock): the one vouched for, where the round and the values are the
        same."""
        vouched = self.vouched
        if vouched is None or vouched[0] != epoch or len(tensors) < self.parameters:
            return None
        if not torch.equal(sampled_values(tensors[: self.parameters], epoch), vouched[2]):
            return None
        return vouched[1]
