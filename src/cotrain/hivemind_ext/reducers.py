"""Robust aggregation inside hivemind's all-reduce: CenteredClip computed by each reducer over its part.

In hivemind's butterfly all-reduce every peer of a group is the reducer of one part of the averaged vector:
the others send it their copy of that part, it returns the average. With ``--aggregation centered-clip``
the reducer returns CenteredClip (Karimireddy, He and Jaggi, 2021; per part inside the all-reduce as in
BTARD, Gorbunov et al., 2022) instead of the weighted mean: starting from the coordinate-wise median of the
contributions, ``iterations`` times ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i``, where ``clip_tau``
scales a difference down to norm ``tau`` when it is longer. No single contribution, however large, moves a
part by more than its share of ``tau`` per iteration; with no contribution farther than ``tau`` from the
result, the result is the weighted mean. ``tau`` is absolute (on a part's L2 norm), or "auto":
``AUTO_TAU_FACTOR`` times the median distance of the contributions from the median, per part, which a
minority of peers cannot inflate. The weights (the samples each peer reports) are capped at their median
(``WEIGHT_CAP``), so that claiming a million samples buys no more pull than an honest peer's share.

Whatever the aggregation, a reducer refuses contributions that are not a part of the expected shape or
hold NaN or Inf: the sender is dropped from the rest of that all-reduce (hivemind's ban of a failed
sender), the round goes on with the others. Each reducer counts, per sender, the contributions it clipped
far outside ``tau`` and the ones it refused (``RobustPartReducer.suspicion``). A peer caught (or, with
centered-clip, dropped for sending nothing within the sender timeout) in ``STRIKES`` all-reduces is
excluded by this peer for ``EXCLUSION_SECONDS``, with one log line naming it: its requests to join this
peer's groups are refused, and in groups it still meets (led by another peer) this peer's reducer refuses
its contributions.

A peer's contribution moves the result by at most tau only where the others hold the median: in a group of
two (frequent when groups fragment) the median is the mean, and where an attacker is the reducer of a part it
returns what it likes. So with centered-clip each peer also bounds what it receives: the group's result is
applied only once it is all in, and moved at most ``RECEIVED_BOUND`` times the norm of the peer's own
contribution away from it (scaled down to that distance when it lay farther). In a pair whose result lay
farther than ``FAR_OUTSIDE`` times the bound, the other peer counts a strike.
"""

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Collection, Sequence
from typing import AsyncIterator  # noqa: UP035 (hivemind recognises typing's, not collections.abc's)

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter, azip

from cotrain.algorithms.aggregation import FAR_OUTSIDE, Aggregation, Mean
from cotrain.algorithms.sparse import Raw, TopK
from cotrain.faults import silent_allreduce
from cotrain.hivemind_ext.direct import DirectTransport
from cotrain.hivemind_ext.hooks import Runner

logger = logging.getLogger(__name__)

# centered-clip: the group's result is applied moved at most this many times the norm of this peer's own
# contribution away from it (honest gradients differ by their noise, less than their norm; in a pair with an
# attacker, or where the attacker is the reducer, the attacker can cancel this peer's update, not reverse it)
RECEIVED_BOUND = 1.0
STRIKES = 3  # all-reduces in which a peer was caught before it is excluded
EXCLUSION_SECONDS = 600.0
# the most samples one contribution's weight may claim: an integer exact in float32, far above what a peer
# accumulates in a round (the weights are summed in float64, so that no group of them overflows)
MAX_WEIGHT = float(2**24)


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer with the aggregation of this module: contributions are kept as they were sent
    until all senders' copies of the current part are in, then combined off the event loop, one combine at a
    time; bad ones are refused (see the module's doc)."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        aggregation: Aggregation,
        excluded: frozenset[int] = frozenset(),
        records: "RecordParts | None" = None,
    ):
        self.aggregation, self.excluded, self.records = aggregation, excluded, records
        self.contributions: dict[int, tuple[torch.Tensor, float]] = {}
        self.outliers = [0] * num_senders  # parts where the sender's copy lay far outside tau
        self.refused = [0] * num_senders  # parts refused: wrong shape, weight, NaN or Inf
        self.combines: list[asyncio.Future] = []  # the parts being combined
        # one thread: a combine's temporaries (a part's dense values) exist once at a time
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reducer")
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        self.accumulator = None  # contributions are kept as sent, not summed
        self.contributions = {}

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        problem = "an excluded peer's part" if sender_index in self.excluded else ""
        problem = problem or self._problem(part_index, tensor_part, weight)
        if problem:  # the caller bans the sender: its parts from this one on are left out, the round goes on
            self.refused[sender_index] += 1
            raise AllreduceException(f"sender {sender_index} sent {problem} for part {part_index}")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.contributions[sender_index] = (tensor_part, float(weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def _problem(self, part_index: int, tensor_part: torch.Tensor, weight: float) -> str:
        if tensor_part.shape != self.part_shapes[part_index]:
            expected = tuple(self.part_shapes[part_index])
            return f"a part of shape {tuple(tensor_part.shape)} (expected {expected})"
        if not (
            math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT
        ):  # a protobuf double: 1e39 is inf in float32
            return f"weight {weight} (expected 0 to {MAX_WEIGHT:.0f} samples)"
        codec = None if self.records is None else self.records.codecs[part_index]
        if codec is not None:
            return codec.problem(tensor_part)
        if not tensor_part.dtype.is_floating_point:
            return f"a part of dtype {tensor_part.dtype}"
        if not torch.isfinite(tensor_part).all():
            return "NaN or Inf"
        return ""

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            future, index = self.current_part_future, self.current_part_index
            contributions = self.contributions
            combine = asyncio.wrap_future(self.pool.submit(self._combine, index, contributions))
            self.combines.append(asyncio.ensure_future(self._resolve(future, index, combine)))
            # a stand-in for the finished part's future, which finalize (after the last part) would cancel
            self.current_part_future = asyncio.get_event_loop().create_future()
            self.reset_accumulators()

    async def _resolve(self, future: asyncio.Future, index: int, combine: asyncio.Future) -> None:
        """Give the senders waiting on ``future`` the result of part ``index`` combined in the reducer's
        thread (or the reason it failed)."""
        try:
            result = await combine
        except Exception as e:
            if not future.done():
                future.set_exception(AllreduceException(f"part {index} could not be combined: {e}"))
            return
        if not future.done():
            future.set_result(result)

    async def drained(self) -> None:
        """Until every part is in and combined."""
        await self.finished.wait()
        await asyncio.gather(*self.combines, return_exceptions=True)

    def finalize(self) -> None:
        super().finalize()
        if hasattr(self, "pool"):
            self.pool.shutdown(wait=False)  # the combines it holds still run

    def _combine(self, index: int, contributions: dict[int, tuple[torch.Tensor, float]]) -> torch.Tensor:
        """The combined part ``index`` (records: re-encoded). A combined part that is not finite is never
        returned, encoded or added to a feedback buffer: from finite contributions of capped weights it cannot
        arise (the weights' shares are summed in float64, the values' mean stays within their range), so it is
        blamed on the sender of the largest values, refused, and the part combined without it."""
        shape = self.part_shapes[index]
        codec = None if self.records is None else self.records.codecs[index]
        senders = sorted(contributions)
        while senders:
            result = self._aggregate(index, codec, senders, contributions)
            if codec is None and finite(result):
                return result.reshape(shape)
            if codec is not None:
                encoded, carried = self.records.reduce_in_place(index, result, len(senders))
                if encoded is not None:
                    return encoded
                if carried:  # the carried residue (now dropped) overflowed it: once more without it
                    continue
            worst = max(senders, key=lambda i: largest(contributions[i][0], codec))
            self.refused[worst] += 1
            senders.remove(worst)
            logger.warning(f"Reducer: part {index} was not finite; refused sender {worst}'s contribution")
        raise AllreduceException(f"no contribution to part {index} left to combine")

    def _aggregate(
        self, index: int, codec: "TopK | Raw | None", senders: list[int], contributions: dict
    ) -> torch.Tensor:
        """The aggregation of the ``senders``' contributions to part ``index``, flat float32. A weighted sum
        is added up one sender at a time into one running sum (records decoded into it a block at a time): the
        reducer holds the part's values once, whatever the number of senders. An aggregation that needs every
        contribution at once (centered-clip) gets them stacked, as they were sent."""
        weights = torch.tensor([contributions[i][1] for i in senders], dtype=torch.float64)
        values = [contributions[i][0] for i in senders]
        numel = dense_numel(values[0], codec)
        shares = self.aggregation.shares(weights)
        if shares is not None:
            total = torch.zeros(numel)
            for data, share in zip(values, shares.tolist(), strict=True):
                add_values(data, total, codec, share)
            return total
        if codec is None:
            result, outliers = self.aggregation.combine(
                torch.stack([v.reshape(-1).float() for v in values]), weights
            )
            self._count_outliers(senders, outliers)
            return result
        # sparse rounds run with the mean only (the run config refuses topk with another aggregation)
        raise AllreduceException(f"{self.aggregation.name} cannot combine records: they are averaged only")

    def _count_outliers(self, senders: list[int], outliers: torch.Tensor | None) -> None:
        if outliers is not None:
            for i, is_far in zip(senders, outliers.tolist(), strict=True):
                self.outliers[i] += int(is_far)

    def suspicion(self) -> list[int]:
        """Per sender: parts refused plus parts clipped far outside tau in this all-reduce."""
        return [a + b for a, b in zip(self.outliers, self.refused, strict=True)]


def finite(values: torch.Tensor, block: int = 2**20) -> bool:
    """Whether every value of ``values`` is finite, checked ``block`` values at a time (no mask of all)."""
    flat = values.reshape(-1)
    return all(bool(torch.isfinite(piece).all()) for piece in flat.split(block))


def dense_numel(data: torch.Tensor, codec: "TopK | Raw | None") -> int:
    """Values of a part as its reducer combines them (records: whole chunks)."""
    if codec is None:
        return data.numel()
    return data.numel() // codec.record * (codec.chunk if isinstance(codec, TopK) else 1)


def add_values(data: torch.Tensor, out: torch.Tensor, codec: "TopK | Raw | None", alpha: float) -> None:
    """Add ``alpha`` times a contribution's values to the flat float32 ``out`` (records decoded into it)."""
    if codec is None:
        out.add_(data.reshape(-1).float(), alpha=alpha)
    else:
        codec.add_decoded(data, out, alpha=alpha)


def largest(data: torch.Tensor, codec: "TopK | Raw | None") -> float:
    """The largest magnitude of a contribution's values."""
    if codec is not None:
        return codec.largest(data)
    return float(data.float().abs().max()) if data.numel() else 0.0


class RecordParts:
    """What a reducer needs for the parts of tensors that travel as records (cotrain.algorithms.sparse): per
    part, the codec of its tensor and the index of its first record (None for a part of a float tensor), and
    this peer's error-feedback buffer, which keeps what the top-k re-encoding of an average leaves out."""

    def __init__(
        self,
        codecs: Sequence[TopK | Raw | None],
        parts: Sequence[torch.Tensor],
        tensors: Sequence[torch.Tensor],
        feedback: torch.Tensor,
        carry: bool = False,
    ) -> None:
        self.feedback, self.carry = feedback, carry
        self.codecs: list[TopK | Raw | None] = []
        self.starts: list[int] = []
        storages = {
            t.untyped_storage().data_ptr(): (codec, t)
            for codec, t in zip(codecs, tensors, strict=False)
            if codec is not None
        }
        for part in parts:  # views of the tensors: a part of a records tensor starts at a record
            codec, tensor = storages.get(part.untyped_storage().data_ptr(), (None, None))
            if codec is None or part.dtype != torch.uint8:
                codec, tensor = None, part
            self.codecs.append(codec)
            self.starts.append((part.storage_offset() - tensor.storage_offset()) // (codec or Raw()).record)

    def reduced(self, part_index: int, average: torch.Tensor, senders: int) -> torch.Tensor:
        """The records of ``average``; what top-k records leave out goes to the feedback buffer, times the
        number of ``senders`` (this peer sends it in its next round, and that round's average divides it
        again). An auxiliary reducer (``carry``), which sends nothing, adds what it kept of these values to
        the average itself the next time it reduces them, times the codec's feedback decay (as every peer's
        buffer fades). ValueError for an average that is not finite."""
        encoded, _ = self.reduce_in_place(part_index, average.clone(), senders)
        if encoded is None:
            raise ValueError(f"the average of part {part_index} is not finite")
        return encoded

    def reduce_in_place(
        self, part_index: int, average: torch.Tensor, senders: int
    ) -> tuple[torch.Tensor | None, bool]:
        """``reduced``, overwriting ``average`` (no copy of a part's values), and whether a carried residue
        was added to it. An average that is not finite is never encoded (None), and a carried residue that
        made it so is dropped; nothing that is not finite is ever added to the buffer."""
        codec = self.codecs[part_index]
        start = self.starts[part_index] * (codec.chunk if isinstance(codec, TopK) else 0)
        end = min(start + average.numel(), self.feedback.numel()) if isinstance(codec, TopK) else start
        carried = False
        if self.carry and end > start:
            residue = self.feedback[start:end]
            if bool(residue.any()):
                average[: end - start].add_(residue, alpha=codec.decay)
                carried = True
            residue.zero_()
        if not finite(average):
            return None, carried
        encoded = codec.encode(average)
        if end > start:
            codec.add_decoded(encoded, average, alpha=-1.0)  # the average is now what its records leave out
            span = self.feedback[start:end]
            span.add_(average[: end - start], alpha=1.0 if self.carry else float(senders))
            if not finite(span):
                span.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return encoded, False


class RobustAllReduceRunner(Runner):
    """hivemind's AllReduceRunner whose reducer is a RobustPartReducer (with ``records``: the codec of each
    tensor that travels as records, None for the others, and the error-feedback buffer)."""

    def __init__(
        self,
        *args,
        aggregation: Aggregation,
        excluded: Collection = (),
        records: tuple[Sequence, torch.Tensor] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        default = self.tensor_part_reducer
        refused = frozenset(i for i, peer in enumerate(self.sender_peer_ids) if peer in excluded)
        parts = None
        if records is not None:
            codecs, feedback = records
            auxiliary = self.modes[self.ordered_peer_ids.index(self.peer_id)] == AveragingMode.AUX
            parts = RecordParts(
                codecs, self.parts_for_local_averaging, kwargs["tensors"], feedback, carry=auxiliary
            )
        self.tensor_part_reducer = RobustPartReducer(
            default.part_shapes, default.num_senders, aggregation, refused, parts
        )
        retire(default)
        self.bounded_by = 0.0  # set where the result was bounded: how many times the bound it lay away

    async def run(self) -> AsyncIterator[torch.Tensor]:
        """hivemind's run, which finalizes this peer's reducer once this peer has all its own results: a peer
        whose own part was refused (NaN, Inf) has them at once, before the others' parts reach its reducer,
        and its reducer then turned those away (each such peer kept its own values for that span). After its
        last result, this peer's reducer first finishes serving the others (bounded by their timeouts: a
        sender that stalls is banned)."""
        outputs = len(self.tensor_part_container.local_tensors)
        yielded = 0
        async for delta in super().run():
            yield delta
            yielded += 1
            if yielded == outputs:
                await self._until_reduced()

    async def _until_reduced(self) -> None:
        reducer = self.tensor_part_reducer
        if reducer.finished.is_set() and all(c.done() for c in reducer.combines):
            return
        bound = sum(t for t in (self.sender_timeout, self.reducer_timeout) if t is not None) or None
        try:
            await asyncio.wait_for(reducer.drained(), bound)
        except TimeoutError:
            logger.debug(f"{self} - its reducer did not finish within {bound} s after this peer's results")

    async def communicate_with_peer(self, peer_id) -> None:
        if peer_id != self.peer_id:
            return await super().communicate_with_peer(peer_id)
        try:
            await super().communicate_with_peer(peer_id)
        except AllreduceException:
            if not self.tensor_part_reducer.refused[self.sender_peer_ids.index(self.peer_id)]:
                raise  # a round failing for another reason fails as in hivemind
            # this peer's own part was refused (NaN, Inf): as for a remote sender, its reducer goes on without
            # it, and its own parts stay as they were (hivemind leaves the local path without this, and the
            # all-reduce then waits forever for the outputs of this peer's own part)
            await self.ban_sender(self.peer_id)
            self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(self.peer_id))
            raise


def received_scale(own_norm: float, moved_norm: float, bound: float = RECEIVED_BOUND) -> float:
    """The factor that brings a received change of norm ``moved_norm`` within ``bound`` times this peer's
    own contribution's norm (1 when it is within, or when this peer contributed nothing to measure by)."""
    if not own_norm > 0 or moved_norm <= bound * own_norm:
        return 1.0
    return bound * own_norm / moved_norm


def retire(reducer: TensorPartReducer) -> None:
    """Finish a reducer that is replaced before it received anything, without hivemind's warning (at every
    all-reduce, on every peer) that it "received 0.0% of input tensors"."""
    if hasattr(reducer, "current_part_future"):
        reducer.current_part_future.cancel()
    reducer.finished.set()


class RobustAveraging(DirectTransport):
    """For a hivemind DecentralizedAverager subclass: its all-reduces use ``self.aggregation``; peers caught
    in ``STRIKES`` all-reduces are excluded for a while (see the module's doc); parts travel over direct
    connections where they can (cotrain.hivemind_ext.direct). Runs in the averager's process."""

    aggregation: Aggregation = Mean()
    records: tuple[Sequence, torch.Tensor] | None = None  # codec per tensor (None: floats), feedback buffer

    def excluded_peers(self) -> set:
        now = time.monotonic()
        until = getattr(self, "_excluded_until", {})
        return {peer for peer, end in until.items() if end > now}

    # no postponed annotations in this module, typing's AsyncIterator: hivemind reads these to register it
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if context.remote_id in self.excluded_peers():
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def run_allreduce(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ) -> None:
        # hivemind's all-reduce of an averager with the runner above (an adapted copy: its entry in
        # cotrain.hivemind_ext.manifest)
        self._direct_ready()
        group_id = group_info.group_id if group_id is None else group_id
        await silent_allreduce(self.running_groups.get(group_id), self.allreduce_timeout)  # fault injection
        runner = RobustAllReduceRunner(
            p2p=self.p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            aggregation=self.aggregation,
            excluded=self.excluded_peers(),
            records=self.records,
            **kwargs,
        )
        assert group_id in self.running_groups, f"Group id {group_id} was not registered"
        self.running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                async for _ in runner:
                    raise ValueError("aux peers should not receive averaged tensors")
            elif self.aggregation.robust and kwargs.get("weight", 1.0) > 0:
                await self._apply_bounded(tensors, runner)
            else:
                async for tensor, update in azip(as_aiter(*tensors), runner):
                    if tensor.dtype == torch.uint8:  # records: the reducer's bytes, whole
                        tensor.add_(update)
                    else:
                        tensor.add_(update, alpha=self.averaging_alpha)
                    self.mark_updated()
        finally:
            self._note_suspicion(runner)

    async def _apply_bounded(self, tensors: Sequence[torch.Tensor], runner: RobustAllReduceRunner) -> None:
        """Apply the group's result only once it is all in, moved at most RECEIVED_BOUND times this peer's
        own contribution from it (see the module's doc)."""
        own = float(torch.sqrt(sum(t.detach().float().pow(2).sum() for t in tensors)))
        updates = [update async for update in runner]
        moved = float(torch.sqrt(sum(u.float().pow(2).sum() for u in updates)))
        scale = received_scale(own, moved)
        if scale < 1.0:
            runner.bounded_by = moved / (RECEIVED_BOUND * own)
            logger.debug(f"All-reduce: the result lay {moved / own:.3g} x this peer's own norm away; bounded")
        for tensor, update in zip(tensors, updates, strict=True):
            tensor.add_(update, alpha=self.averaging_alpha * scale)
        self.mark_updated()

    def _note_suspicion(self, runner: RobustAllReduceRunner) -> None:
        reducer = runner.tensor_part_reducer
        if not isinstance(reducer, RobustPartReducer):
            return
        if not hasattr(self, "_strikes"):
            self._strikes, self._excluded_until = {}, {}
        counts = dict(zip(runner.sender_peer_ids, reducer.suspicion(), strict=True))
        others = [peer for peer in runner.ordered_peer_ids if peer != self.peer_id]
        if runner.bounded_by > FAR_OUTSIDE and len(others) == 1:  # a pair: only the other could move it so
            counts[others[0]] = counts.get(others[0], 0) + 1
        # sent nothing (or stopped) within the sender timeout: a strike with centered-clip only; with the mean
        # a slow honest peer (a loaded machine, a congested link) must not be excluded for being late
        for peer_id in runner.banned_senders if self.aggregation.robust else ():
            counts[peer_id] = counts.get(peer_id, 0) + 1
        for peer_id, count in counts.items():
            if not count or peer_id == self.peer_id:
                continue
            self._strikes[peer_id] = self._strikes.get(peer_id, 0) + 1
            logger.info(
                f"All-reduce: {count} part(s) from peer {peer_id} refused or clipped far outside tau (strike "
                f"{self._strikes[peer_id]} of {STRIKES})"
            )
            if self._strikes[peer_id] >= STRIKES and peer_id not in self.excluded_peers():
                self._excluded_until[peer_id] = time.monotonic() + EXCLUSION_SECONDS
                self._strikes[peer_id] = 0
                logger.warning(
                    f"Excluding peer {peer_id} from averaging for {EXCLUSION_SECONDS:.0f} s: its "
                    f"contributions were refused or clipped far outside tau in {STRIKES} all-reduces"
                )
