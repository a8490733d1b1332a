"""DiLoCo's sparse rounds (--outer-compression topk, cotrain.algorithms.sparse).

Here, in the test process alone; the rest in tests/live/test_sparse.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from cotrain.algorithms.aggregation import Mean
from cotrain.algorithms.sparse import (
    BLOCK,
    CHUNK,
    Raw,
    TopK,
    pack_bits,
    pack_indices,
    unpack_bits,
    unpack_indices,
    upper_bytes,
)
from cotrain.config.run import RunConfig
from cotrain.hivemind_ext.reducers import RecordParts, RobustPartReducer
from cotrain.strategies.overlap import RoundStart, encode_with_feedback


def test_the_codec_keeps_k_per_chunk_and_its_feedback_holds_exactly_what_was_not_sent():
    codec = TopK()
    # Elias-Fano indices: 16 bytes of high parts in unary, 64 x 6 low bits; 16 bytes of codes; 2 levels
    assert (codec.k, codec.index_bytes, codec.record) == (64, 64, 84) and 2 * CHUNK / codec.record > 97
    values = torch.randn(3 * CHUNK + 100, generator=torch.Generator().manual_seed(0))
    records = codec.encode(values)
    assert records.dtype == torch.uint8 and records.numel() == codec.encoded_size(values.numel()) == 4 * 84
    assert codec.problem(records) == ""
    sent = codec.decode(records, values.numel())
    assert sent.shape == values.shape
    # k values per chunk (the last chunk is padded with zeros: its k include none of the padding's)
    chunks = torch.nn.functional.pad(sent, (0, 4 * CHUNK - sent.numel())).view(4, CHUNK)
    assert ((chunks != 0).sum(1) == codec.k).all()
    # the kept values are each chunk's largest, each sent as the nearest of its chunk's two levels, its sign
    # kept: the means of the kept magnitudes below and above their midpoint (bfloat16)
    kept = sent != 0
    for row, original in zip(
        chunks, torch.nn.functional.pad(values, (0, 4 * CHUNK - values.numel())).view(4, CHUNK), strict=True
    ):
        top = original.abs().topk(codec.k).indices
        assert set(top.tolist()) == set(torch.nonzero(row).flatten().tolist())
        magnitudes = original[top].abs()
        upper = magnitudes > (magnitudes.min() + magnitudes.max()) / 2
        levels = torch.stack([magnitudes[~upper].mean(), magnitudes[upper].mean()])
        levels = levels.to(torch.bfloat16).float()
        nearest = levels[(magnitudes[:, None] - levels).abs().argmin(dim=1)]
        assert torch.equal(row[top], torch.where(original[top] < 0, -nearest, nearest))
    # levels where the kept magnitudes lie: a heavy-tailed chunk's values are sent within a quarter of their
    # norm at 2 bits, where levels spread evenly up to its largest magnitude would be 86% off
    heavy = torch.distributions.StudentT(3.0).sample((64 * CHUNK,))
    for bits, bound in ((2, 0.3), (4, 0.1), (8, 0.01)):
        coarse = TopK(bits=bits)
        got = coarse.decode(coarse.encode(heavy), heavy.numel())
        assert (got - heavy)[got != 0].norm() <= bound * heavy[got != 0].norm(), bits
    # error feedback: what stays behind is exactly the rest (sent + kept back = the whole)
    feedback = values - sent
    assert torch.equal(sent + feedback, values)
    assert torch.equal(feedback[~kept], values[~kept])
    assert TopK(bits=4).record == 64 + 32 + 4
    # an all-zero vector: zero levels, zero values; fewer values than a chunk: the kept zeros stay zeros
    zeros = codec.encode(torch.zeros(10))
    assert codec.problem(zeros) == "" and codec.decode(zeros, 10).abs().sum() == 0
    few = torch.arange(-1.0, -11.0, -1.0)
    assert torch.equal(codec.decode(codec.encode(few), 10), torch.tensor([0.0] * 4 + [-8.0] * 6))
    # the outer state's bytes: exact
    raw = Raw()
    assert torch.equal(raw.decode(raw.encode(values)), values) and raw.problem(raw.encode(values)) == ""
    # a vector of several blocks of chunks, the last chunk partial: each chunk's record is the one it has
    # alone, and the feedback's update adds the decoded values where they lie, in place
    long = torch.randn((2 * BLOCK + 3) * CHUNK - 5, generator=torch.Generator().manual_seed(1))
    records = codec.encode(long)
    for i in (0, BLOCK - 1, BLOCK, 2 * BLOCK + 2):
        alone = codec.encode(long[i * CHUNK : (i + 1) * CHUNK])  # the last: padded as in the whole
        assert torch.equal(records.view(-1, codec.record)[i], alone), i
    rest = long.clone()
    codec.add_decoded(records, rest, alpha=-1.0)
    assert torch.equal(rest, long - codec.decode(records, long.numel()))
    # a round's change joins the feedback times the decay; the buffer then holds exactly what was not sent
    fading = TopK(decay=0.9)
    change, buffer = values.clone(), long[: values.numel()].clone()
    whole = torch.add(change, buffer, alpha=0.9)
    records = encode_with_feedback(fading, change, buffer)
    assert torch.equal(records, fading.encode(whole)) and torch.equal(change, whole)
    assert torch.allclose(buffer, whole - fading.decode(records, whole.numel()), atol=1e-6)
    with pytest.raises(ValueError, match="decay"):
        TopK(decay=0.0)


def test_an_overlapped_round_computed_in_place_is_the_copying_one_to_the_bit():
    gen = torch.Generator().manual_seed(2)
    first = [torch.randn(300, 7, generator=gen), torch.randn(11, generator=gen)]
    made = [first, [t.clone() for t in first]]
    starts = [RoundStart(params, in_place=flag) for params, flag in zip(made, (True, False), strict=True)]
    lock = threading.Lock()
    for _ in range(3):  # inner steps move the parameters, then the round's end
        step = [torch.randn(t.shape, generator=gen) * 1e-2 for t in made[0]]
        for params in made:
            for t, s in zip(params, step, strict=True):
                t.sub_(s)
        changes = [start.change() for start in starts]
        assert all(torch.equal(a, b) for a, b in zip(*changes, strict=True))
        glob = [torch.randn(t.shape, generator=gen) for t in made[0]]
        for start, change in zip(starts, changes, strict=True):
            start.next_round(glob, change, lock)
        assert all(torch.equal(a, b) for a, b in zip(*made, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(starts[0].tensors, starts[1].tensors, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(starts[0].tensors, made[0], strict=True))


def _with(records: torch.Tensor, codec: TopK, field: str, value: int) -> torch.Tensor:
    bad = records.clone().view(-1, codec.record)
    head = upper_bytes(codec.chunk, codec.k)
    index, _ = unpack_indices(bad[:, : codec.index_bytes], codec.chunk, codec.k)
    if field == "repeat":
        index[0, 1] = index[0, 0]  # the second index equals the first
        bad[:, : codec.index_bytes] = pack_indices(index, codec.chunk)
    upper = unpack_bits(bad[:, :head])
    ones = torch.nonzero(upper[0]).flatten()
    if field == "index-high":  # the last index's high part one beyond the chunk's last
        upper[0, ones[-1]] = 0
        upper[0, codec.k + (codec.chunk >> 6) - 1] = 1  # (a chunk of 1024, 16 kept: 6 low bits)
    elif field == "extra":  # a 17th index
        upper[0, torch.nonzero(upper[0] == 0).flatten()[0]] = 1
    elif field == "missing":  # a 15th
        upper[0, ones[0]] = 0
    bad[:, :head] = pack_bits(upper)
    if field == "scale":
        bad[0, -4:] = torch.tensor([float("nan")]).view(torch.uint8)
    return bad.view(-1)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda r, c: _with(r, c, "index-high", 0), "beyond the chunk"),
        (lambda r, c: _with(r, c, "repeat", 0), "not strictly increasing"),
        (lambda r, c: _with(r, c, "extra", 0), "other than 16 indices"),
        (lambda r, c: _with(r, c, "missing", 0), "other than 16 indices"),
        (lambda r, c: _with(r, c, "scale", 0), "scale"),
        (lambda r, c: r[:-1], "whole number"),
        (lambda r, c: r.float(), "dtype"),
    ],
)
def test_malformed_records_are_named(make, words):
    codec = TopK(chunk=1024)
    records = codec.encode(torch.randn(2 * 1024))
    assert words in codec.problem(make(records, codec))


def test_a_reducer_refuses_malformed_records_and_returns_the_same_records_of_the_average_to_everyone():
    codec = TopK()
    numel = 2 * CHUNK
    local = torch.zeros(codec.encoded_size(numel), dtype=torch.uint8)
    feedback = torch.zeros(numel)
    parts = [local[: codec.record], local[codec.record :]]  # two parts: one chunk each
    values = [torch.randn(numel, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    sent = [codec.encode(v) for v in values]

    async def reduce(contributions: list[torch.Tensor], weights: list[float]):
        reducer = RobustPartReducer(
            [p.shape for p in parts],
            len(contributions),
            Mean(),
            records=RecordParts([codec], parts, [local], feedback),
        )
        results = {}

        async def sender(i: int):
            out = []
            for index, part in enumerate(parts):
                piece = contributions[i][part.storage_offset() : part.storage_offset() + part.numel()]
                try:
                    out.append(await reducer.accumulate_part(i, index, piece, weight=weights[i]))
                except AllreduceException as e:
                    reducer.on_sender_failed(i)
                    out.append(str(e))
                    break
            results[i] = out

        await asyncio.gather(*(sender(i) for i in range(len(contributions))))
        return reducer, results

    reducer, results = asyncio.run(reduce(sent[:2], [1.0, 3.0]))
    assert results[0] == results[1] or all(
        torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True)
    )
    averaged = torch.cat(results[0])
    assert averaged.dtype == torch.uint8 and codec.problem(averaged) == ""
    mean = (codec.decode(sent[0]) * 1.0 + codec.decode(sent[1]) * 3.0) / 4.0
    got = codec.decode(averaged)
    assert torch.equal(got, codec.decode(codec.encode(mean)))  # the records of the weighted mean
    # what the records of the mean left out went to this reducer's feedback, times its 2 senders
    torch.testing.assert_close(feedback, 2 * (mean - got))

    # a sender whose records are malformed is refused (and counted), the others are averaged without it
    feedback.zero_()
    bad = _with(sent[2], codec, "repeat", 0)
    reducer, results = asyncio.run(reduce([sent[0], bad], [1.0, 1.0]))
    assert reducer.refused == [0, 1] and "not strictly increasing" in results[1][0]
    assert torch.equal(torch.cat(results[0]), codec.encode(codec.decode(sent[0])))


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"outer_compression": "topk"}, "needs --strategy diloco"),
        ({"outer_compression": "topk", "strategy": "diloco", "aggregation": "centered-clip"}, "mean only"),
        ({"outer_compression": "sparse"}, "must be one of dense, topk"),
        ({"topk_bits": 3}, "topk_bits must be one of 2, 4, 8"),
        ({"topk_density": 0.9}, "topk_density must be in (0, 0.5]"),
        ({"topk_feedback_decay": 1.5}, "topk_feedback_decay must be in (0, 1]"),
    ],
)
def test_bad_outer_compression_settings_are_named(values, words):
    problems = RunConfig(**values).problems()
    assert any(words in p for p in problems), problems
    from cotrain.algorithms.codecs import TOPK_BITS
    from cotrain.algorithms.sparse import BITS

    assert TOPK_BITS == BITS  # what the config accepts is what the codec sends


def test_the_command_line_sets_sparse_rounds_and_their_outer_step(capsys):
    from cotrain import cli

    _, config = cli.parse(
        ["train", "--preset", "llama-tiny", "--strategy", "diloco", "--outer-compression", "topk"]
    )
    run = config.run
    assert (run.outer_compression, run.topk_density, run.topk_bits) == ("topk", 1 / 64, 2)
    assert run.topk_feedback_decay == 0.9
    assert (run.outer_lr, run.outer_momentum) == (1.0, 0.0)  # SparseLoCo's outer step unless given
    _, config = cli.parse(
        ["train", "--preset", "llama-tiny", "--strategy", "diloco", "--outer-compression", "topk"]
        + ["--outer-momentum", "0.5", "--topk-bits", "4", "--topk-feedback-decay", "1"]
    )
    assert (config.run.outer_lr, config.run.outer_momentum, config.run.topk_bits) == (1.0, 0.5, 4)
    assert config.run.topk_feedback_decay == 1.0
    assert cli.main(["train", "--preset", "llama-tiny", "--outer-compression", "topk"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs --strategy diloco" in err[0], err
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--outer-compression" in capsys.readouterr().out
