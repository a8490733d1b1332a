"""Which donors a state download asks, in which order (cotrain.hivemind_ext.statecheck): refuted donors
(suspects) and donors that could not be reached last, donors ahead of the downloader and vouched for first,
donors beyond the witnessed step only when no other serves; and the opening of a download that tells an
unreachable donor apart (no connection, or no first message, within ``OPEN_TIMEOUT``)."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from typing import Any

SUSPECT_SECONDS = 600.0  # a donor whose state was refuted is asked last for this long
OPEN_TIMEOUT = 15.0  # seconds for a donor's connection and first message (each later one: the chunk timeout)
UNREACHABLE_SECONDS = 300.0  # a donor that could not be reached is asked last for this long


def donor_order(
    priorities: Mapping[str, float],
    records: Mapping[Any, Any],
    suspects: Mapping[str, float],
    held: float = -1,
) -> list[tuple[str, bool]]:
    """The donors (peer ids) to ask, in order, each with whether it is worth asking once an unverifiable state
    is in hand: suspects last; then the donors whose declared step (their priority, rounded down) is ahead of
    ``held``, the downloader's own step; among those, the ones whose step another peer published a record for
    (vouched for) first; then by priority (ties in random order, as hivemind breaks them). Where some donor is
    ahead, a vouched-for donor that is not cannot bring the downloader forward: not worth asking."""

    def vouched(donor: str, priority: float) -> bool:
        step = math.floor(priority) if math.isfinite(priority) else None
        return any(step in p.steps for p in records.values() if p.peer_id != donor)

    rows = [(donor, vouched(donor, p), p >= held + 1, p) for donor, p in priorities.items()]  # held: a step
    some_ahead = any(ahead for _, _, ahead, _ in rows)
    rows.sort(key=lambda r: (r[0] not in suspects, r[2], r[1], r[3], random.random()), reverse=True)
    return [(donor, v and (ahead or not some_ahead)) for donor, v, ahead, _ in rows]


class DonorUnreachable(Exception):
    """A donor with which no connection opened, or that sent no first message, within ``OPEN_TIMEOUT``."""


async def opened(call: Any, timeout: float = OPEN_TIMEOUT) -> tuple[Any, Any]:
    """A download stream once the donor's connection opened and its first message arrived: (the stream, that
    message; None when the stream ended at once). Raises DonorUnreachable when that takes over ``timeout``
    s or the connection cannot be opened."""

    async def first() -> tuple[Any, Any]:
        stream = await call
        try:
            return stream, await anext(stream)
        except StopAsyncIteration:
            return stream, None

    try:
        return await asyncio.wait_for(first(), timeout)
    except TimeoutError as e:
        raise DonorUnreachable(f"no answer within {timeout:.0f} s") from e
    except Exception as e:  # the daemon's dial errors ("failed to dial", "dial backoff"), a refusal
        raise DonorUnreachable((str(e).splitlines() or [repr(e)])[0][:200]) from e


async def chained(first: Any, stream: Any):
    """``first`` (unless None), then the rest of ``stream``."""
    if first is not None:
        yield first
        async for message in stream:
            yield message


def within_witnessed(
    priorities: Mapping[str, float], witnessed: int | None
) -> tuple[dict[str, float], list[str]]:
    """The donors to ask (peer id -> priority, its declared step) and those left out: a donor whose step is
    beyond ``witnessed + 1`` (``witnessed``: the epoch that two other full peers reached, from their
    progress records) is left out while some donor within it serves. A lone liar that runs ahead of the
    swarm (it claims the samples that end its own steps at once) would otherwise be the first donor of every
    newcomer and of every peer that lags, which would then hold its epoch and be the second witness that the
    robust progress tracker asks for. One step of slack: honest peers step at slightly different times."""
    if witnessed is None:
        return dict(priorities), []
    within = {d: p for d, p in priorities.items() if math.isfinite(p) and math.floor(p) <= witnessed + 1}
    if not within:
        return dict(priorities), []
    return within, [d for d in priorities if d not in within]
