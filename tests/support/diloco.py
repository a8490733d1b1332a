"""Helpers the test_diloco tests share across suites."""

from __future__ import annotations


def peer_ids(n: int) -> list:
    from hivemind.p2p import PeerID

    return [PeerID(bytes([0x12, 0x20, i] + [7] * 32)) for i in range(1, n + 1)]


def served(holder, epoch: int, inner_steps: int | None = None, lineage: bytes | None = None, **changes):
    """What a donor holding ``holder``'s outer state serves at round ``epoch`` (``changes``: in its
    metadata)."""
    from hivemind.optim.state_averager import dump_optimizer_state

    params = [p.detach().clone() for p in holder.global_parameters]
    meta, statistics = dump_optimizer_state(holder.optimizer)
    metadata = dict(
        epoch=epoch,
        strategy="diloco",
        optimizer_metadata=meta,
        outer_tensors=len(params) + len(statistics),
        inner_metadata=[],
        inner_steps=epoch * holder.local_steps if inner_steps is None else inner_steps,
    )
    if lineage is not None:
        metadata["lineage"] = lineage
    metadata.update(changes)
    return metadata, [*params, *(t.clone() for t in statistics)]
