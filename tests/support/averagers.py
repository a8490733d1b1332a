"""A swarm of hivemind averagers with cotrain's all-reduce on 127.0.0.1, for the tests of robust and direct
all-reduces."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cotrain.algorithms.aggregation import (
    Aggregation,
)


def averagers(
    tensors: list[list[torch.Tensor]],
    aggregation: Aggregation,
    direct=None,
    records: Path | None = None,
    **options,
):
    """One hivemind averager with cotrain's all-reduce (robust reducers, the direct path where ``direct``, one
    bool per peer, says so: all by default) per entry of ``tensors``, in one swarm; ``options`` replace the
    averagers' settings. With ``records`` (a folder), each writes there what its last all-reduce dropped."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    from cotrain.hivemind_ext.reducers import RobustAveraging

    class Averager(RobustAveraging, DecentralizedAverager):
        def __init__(self, *args, aggregation, record=None, **kwargs):
            self.aggregation, self.record = aggregation, record
            super().__init__(*args, **kwargs)

        def _note_suspicion(self, runner) -> None:  # in the averager's process: what its all-reduce dropped
            super()._note_suspicion(runner)
            if self.record is not None:
                banned = sorted(str(p) for p in runner.banned_senders)
                failed = runner.tensor_part_container.failed_size
                self.record.write_text(json.dumps({"banned": banned, "failed": failed}))

    local = ["/ip4/127.0.0.1/tcp/0"]
    first = hivemind.DHT(start=True, host_maddrs=local)
    dhts = [first] + [
        hivemind.DHT(start=True, host_maddrs=local, initial_peers=first.get_visible_maddrs())
        for _ in tensors[1:]
    ]
    settings = dict(
        prefix="robust-test",
        target_group_size=len(tensors),
        min_matchmaking_time=5.0,
        request_timeout=2.0,
        next_chunk_timeout=5.0,
    )
    settings.update(options)
    direct = [True] * len(tensors) if direct is None else direct
    made = [
        Averager(
            [t.clone() for t in own],
            dht,
            aggregation=aggregation,
            record=None if records is None else records / f"{i}.json",
            direct=d,
            start=True,
            **settings,
        )
        for i, (own, dht, d) in enumerate(zip(tensors, dhts, direct, strict=True))
    ]
    return made, dhts
