"""A sparse round's reducer: its peak memory and the combine's time as senders are added, against the stacked
combine it replaced.

A reducer of sparse DiLoCo rounds (``--outer-compression topk``; the monitor, as the auxiliary reducer of its
clients) receives each sender's records of one part of the pseudo-gradient and returns the records of their
average (cotrain.hivemind_ext.reducers). This script feeds ``RobustPartReducer`` one part of ``--part-mb`` MB
of records (the default codec: 1/64 of each chunk of 4096 values in 2 bits, 84 bytes a chunk) from each of N
senders, N in ``--senders``, through its ``accumulate_part`` as hivemind's all-reduce does, on an auxiliary
reducer that carries what its records leave out (as the monitor does). Each measurement runs in a fresh
process: the peak resident memory (``ru_maxrss``) above what the process held once the senders' records were
made, and the seconds from the last sender's part to the result. ``stacked`` is the combine the reducer ran
before, measured the same way: every sender's records decoded to dense float32 and stacked, their weighted
mean, then the re-encoding with the residue kept.

    python benchmarks/reducer_memory.py [--senders 2 8 16] [--part-mb 0.5]

Prints a table and, last, a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time


def measure(mode: str, senders: int, part_mb: float) -> dict:
    import torch

    from cotrain.algorithms.aggregation import Mean
    from cotrain.algorithms.sparse import TopK
    from cotrain.hivemind_ext.reducers import RecordParts, RobustPartReducer

    torch.set_num_threads(1)
    codec = TopK()
    records = max(1, int(part_mb * 1e6) // codec.record)
    numel = records * codec.chunk
    generator = torch.Generator().manual_seed(0)
    sent = [codec.encode(torch.randn(numel, generator=generator)) for _ in range(senders)]
    local = torch.zeros(records * codec.record, dtype=torch.uint8)
    feedback = torch.zeros(numel)
    feedback.fill_(1e-3)  # the reducer's buffer, resident before the baseline (it holds a residue already)
    parts = RecordParts([codec], [local], [local], feedback, carry=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the high-water mark so far

    if mode == "stacked":
        started = time.perf_counter()
        stacked = torch.stack([codec.decode(s) for s in sent])
        average = torch.full((senders,), 1.0 / senders) @ stacked
        del stacked
        parts.reduced(0, average, senders)
        seconds = time.perf_counter() - started
    else:

        async def main() -> float:
            reducer = RobustPartReducer([local.shape], senders, Mean(), records=parts)
            clock: list[float] = []

            async def send(i: int) -> None:
                if i == senders - 1:
                    clock.append(time.perf_counter())
                await reducer.accumulate_part(i, 0, sent[i], weight=1.0)

            await asyncio.gather(*(send(i) for i in range(senders)))
            return time.perf_counter() - clock[0]

        seconds = asyncio.run(main())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dense_mib = numel * 4 / 2**20
    return {
        "mode": mode,
        "senders": senders,
        "part_mb": records * codec.record / 1e6,
        "dense_mib": round(dense_mib, 1),
        "peak_mib": round((peak - before) / 1024, 1),
        "seconds": round(seconds, 2),
    }


def one_command(mode: str, senders: int, part_mb: float) -> list[str]:
    """One measurement's process: this script with ``--one MODE SENDERS``."""
    return [sys.executable, __file__, "--one", mode, str(senders), "--part-mb", str(part_mb)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--part-mb", type=float, default=0.5)
    modes = ["streamed", "stacked"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # MODE SENDERS: one measurement, here
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.part_mb)))
        return
    rows = []
    for senders in args.senders:
        for mode in args.modes:
            out = subprocess.run(
                one_command(mode, senders, args.part_mb),
                check=True,
                capture_output=True,
                text=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'mode':>9} {'senders':>7} {'part MB':>7} {'dense MiB':>9} {'peak MiB':>9} {'combine s':>9}")
    for r in rows:
        print(
            f"{r['mode']:>9} {r['senders']:>7} {r['part_mb']:>7.2f} {r['dense_mib']:>9.1f} "
            f"{r['peak_mib']:>9.1f} {r['seconds']:>9.2f}"
        )
    print(json.dumps({"event": "reducer_memory", "rows": rows}))


if __name__ == "__main__":
    main()
