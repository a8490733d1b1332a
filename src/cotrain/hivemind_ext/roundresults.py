"""A round's result, kept by the peers that averaged it and served to a peer that missed it.

A DiLoCo peer that reaches the end of its round after the round's group formed without it (a slow peer, a
loaded host, a record read late) used to apply its own change alone: its outer state then left the swarm's,
it took a fresh lineage, and its next group carried the whole outer state in float32 to bring it back
(cotrain.algorithms.lineage). Instead, it *catches up*: it asks peers that finished the round for the
averaged changes their group received (``RoundResult``: in sparse rounds the averaged records, the size of
one peer's records), applies the same outer step to the same outer state, and so holds what they hold, to
the bit, in the lineage the round gave them; its own change goes into its next round (the error-feedback
buffer keeps it). Nothing of its work is lost, no one waits for it, and no later round carries the outer
state for its sake.

Each peer keeps the results of its last ``KEEP_ROUNDS`` whole rounds, with the lineage its group held
before the round: a peer is served only the result of a round it could have been in, from the outer state
it holds. What a donor sends is checked against the asking peer's own averager (as many tensors, the same
shapes and types, a digest over all of it); a second donor, where the swarm has one, must send the same
digest, or nothing is taken.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads a stream off typing's name)

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from cotrain.algorithms.lineage import LINEAGE_BYTES, digest_tensors
from cotrain.hivemind_ext.hooks import Averager

logger = logging.getLogger(__name__)

KEEP_ROUNDS = 4  # whole rounds whose results a peer keeps to serve
MAX_DONORS = 4  # peers asked, in a random order, before a catch-up gives up
DIGEST_BYTES = 32


@dataclass(frozen=True)
class RoundResult:
    """What a group's members received in round ``round``: the averaged changes (``tensors``, as the round
    averager holds them), the lineage the members held before (``before``) and the one the round gave them
    (``after``)."""

    round: int
    before: bytes
    after: bytes
    tensors: tuple[torch.Tensor, ...]

    @property
    def digest(self) -> bytes:
        return result_digest(self.round, self.before, self.after, self.tensors)


def result_digest(round_: int, before: bytes, after: bytes, tensors: Sequence[torch.Tensor]) -> bytes:
    """A digest of a round's result: its round, both lineages, and every tensor's shape, type and bytes."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"cotrain-result")
    digest.update(str(int(round_)).encode() + before + after)
    digest_tensors(digest, tensors)
    return digest.digest()


def _lineage(value: Any) -> bool:
    return isinstance(value, bytes) and len(value) == LINEAGE_BYTES


class ServesRoundResults(Averager):
    """An averager that keeps its last rounds' results (``keep_result``), serves them to the peers of the
    same lineage that missed them (``rpc_round_result``) and fetches one for itself (``fetch_result``)."""

    # hivemind collects a servicer's rpc_* handlers once per class and caches them on it: None here, so that
    # a class built on this one collects its own (rpc_round_result among them), not a base's cached list
    _rpc_handlers = None
    _stub_type = None

    def keep_result(self, result: RoundResult) -> None:
        """Keep ``result`` to serve (its tensors copied by the caller); the oldest beyond KEEP_ROUNDS go. Kept
        where the averager serves (its thread or its process)."""
        self.ask_serving_loop("_keep_result", result=result)

    async def _keep_result(self, result: RoundResult) -> None:
        self._results.append(result)

    @property
    def _results(self) -> deque:
        return self.__dict__.setdefault("_kept_results", deque(maxlen=KEEP_ROUNDS))

    def _kept(self, round_: Any, before: Any) -> RoundResult | None:
        return next((r for r in self._results if r.round == round_ and r.before == before), None)

    async def rpc_round_result(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Serve the result of the round a peer asks for (``{"round", "lineage", "whole"}``): a first message
        with its digest and the lineage it gave (nothing where no result of that round and lineage is kept),
        then, when ``whole``, its tensors."""
        try:
            asked = self.serializer.loads(request.metadata)
        except Exception:
            return
        if not isinstance(asked, dict) or not isinstance(asked.get("round"), int):
            return
        result = self._kept(asked["round"], asked.get("lineage"))
        if result is None:
            return
        header = self.serializer.dumps({"after": result.after, "digest": result.digest})
        yield averaging_pb2.DownloadData(metadata=header)
        if asked.get("whole") is True:
            for tensor in result.tensors:
                for part in split_for_streaming(serialize_torch_tensor(tensor)):
                    yield averaging_pb2.DownloadData(tensor_part=part)

    def fetch_result(
        self, donors: Sequence[bytes], round_: int, lineage: bytes, timeout: float
    ) -> RoundResult | None:
        """The result of round ``round_`` for a peer of ``lineage``, from ``donors`` (the ids of peers that
        finished the round), checked (see the module's doc); None when none serves one that passes within
        ``timeout``."""
        if not donors or timeout <= 0:
            return None
        future = MPFuture()
        self.ask_serving_loop(
            "_fetch_result",
            future=future,
            donors=[PeerID(donor) for donor in donors],
            round_=round_,
            lineage=lineage,
            timeout=timeout,
        )
        try:
            return future.result(timeout + 1.0)
        except BaseException as e:
            logger.debug(f"Round {round_}: no result fetched ({type(e).__name__}: {e})")
            return None

    async def _fetch_result(self, future: MPFuture, donors, round_, lineage, timeout) -> None:
        try:
            result = await asyncio.wait_for(self._checked_result(donors, round_, lineage), timeout)
        except BaseException as e:
            result = None
            logger.debug(f"Round {round_}: fetching its result stopped ({type(e).__name__}: {e})")
        if not future.done():
            future.set_result(result)

    async def _checked_result(self, donors, round_: int, lineage: bytes) -> RoundResult | None:
        donors = random.sample(list(donors), len(donors))[:MAX_DONORS]
        with self.get_tensors() as tensors:
            template = [(t.shape, t.dtype) for t in tensors[: self.result_tensors]]
        got, confirmed, asked_others = None, False, False
        for donor in donors:
            try:
                if got is None:
                    got = await self._ask(donor, round_, lineage, template)
                    continue
                asked_others = True
                header = await self._ask(donor, round_, lineage, None)
            except Exception as e:
                logger.debug(f"Round {round_}: peer {donor} served no result ({type(e).__name__}: {e})")
                continue
            if header is None:
                continue
            if header[1] != got.digest:
                logger.warning(
                    f"Round {round_}: two peers served different results of the round; neither is taken"
                )
                return None
            confirmed = True
            break
        if got is not None and not confirmed and asked_others:
            logger.info(f"Round {round_}: no second peer confirmed the round's result; taking it from one")
        return got

    async def _ask(self, donor: PeerID, round_: int, lineage: bytes, template: list | None) -> Any:
        """One donor's answer: with a ``template`` (shapes and types), the whole result, checked against it;
        without, (the lineage it gave, its digest). None: the donor keeps none."""
        asked = {"round": round_, "lineage": lineage, "whole": template is not None}
        request = averaging_pb2.DownloadData(metadata=self.serializer.dumps(asked))
        stub = self.get_stub(self.p2p, donor, namespace=self.prefix)
        stream = await stub.rpc_round_result(request)
        header, parts, tensors = None, [], []
        limit = None if template is None else sum(_nbytes(s, d) for s, d in template)
        received = 0
        async for message in aiter_with_timeout(stream, timeout=self.request_timeout):
            if header is None:
                header = self.serializer.loads(message.metadata)
                if (
                    not isinstance(header, dict)
                    or not _lineage(header.get("after"))
                    or not isinstance(header.get("digest"), bytes)
                ):
                    raise ValueError("a malformed header")
                if template is None:
                    return header["after"], header["digest"]
                continue
            received += len(message.tensor_part.buffer)
            if received > limit + 4096 * (len(template) + 1):
                raise ValueError("more bytes than the round's tensors hold")
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if header is None:
            return None
        if template is None:
            return None
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if len(tensors) != len(template) or any(
            t.shape != shape or t.dtype != dtype for t, (shape, dtype) in zip(tensors, template, strict=False)
        ):
            raise ValueError("tensors of other shapes or types than the round's")
        result = RoundResult(round_, lineage, header["after"], tuple(tensors))
        if result.digest != header["digest"]:
            raise ValueError("tensors that do not match the digest served with them")
        return result

    @property
    def result_tensors(self) -> int:
        """How many of the averager's tensors a round's result holds (the averaged changes): all of them
        unless a subclass says otherwise."""
        with self.get_tensors() as tensors:
            return len(tensors)


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
