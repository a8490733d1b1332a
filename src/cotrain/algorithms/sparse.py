"""DiLoCo's sparse rounds: the pseudo-gradient as the top-k values of each chunk, quantized, with error
feedback.

``--outer-compression topk`` (swarm-wide: it changes the math). Each peer adds its error-feedback buffer,
times ``--topk-feedback-decay`` (``TopK.decay``: what stays unsent fades, as in SparseLoCo), to its round's
pseudo-gradient, splits the sum into chunks of ``CHUNK`` values, keeps the ``k`` of largest
magnitude in each (``k``: ``--topk-density`` of the chunk, a multiple of 8), quantizes them to ``--topk-bits``
bits, and keeps what it did not send (the values left out and the rounding of those sent) in its buffer for
the next round.

A code is a sign bit and ``bits - 1`` bits of magnitude: one of ``2**(bits-1)`` levels of the chunk, from
``low`` to ``high`` (``levels``), each value to the nearest. At 4 and 8 bits ``low`` and ``high`` are the
smallest and largest kept magnitudes and the levels between them are spaced quadratically (finer near the
low end, where most of the kept magnitudes of a heavy-tailed chunk lie); at 2 bits the two levels are the
means of the kept magnitudes below and above their midpoint (a step of Lloyd's algorithm). Where a kept value
is 0 (a chunk with fewer than ``k`` values that are not) ``low`` is 0, so that zeros stay zeros. Levels
spread evenly over [-max, max] instead would round most of a heavy-tailed chunk's kept values to a third of
its largest at 2 bits: on Student-t values (3 degrees of freedom), an error of 86% of the kept values' norm,
against 24% with these levels (docs/benchmarks.md).

A chunk travels as one fixed-size record: its ``k`` indices (strictly increasing) in Elias-Fano form, the
``k`` codes packed ``8 // bits`` to a byte, and ``low`` and ``high`` (bfloat16 each: the levels are made from
their rounded values, on the encoder as on every decoder, with the same float32 operations, so that every
member of a group decodes the same bits). Elias-Fano splits each index into its
low ``L = log2(chunk / k)`` bits, written as they are, and its high bits, written in unary as one bit set
per index in a bit vector of ``k + chunk / 2**L`` bits: for a given ``k`` and chunk a fixed size, about ``2
+ L`` bits an index (8 where plain indices of 4096 take 12). At the defaults, k = 64 of 4096 at 2 bits: 64
bytes of indices, 16 of codes and 4 of levels, 84 bytes against 8,192 in fp16, **97x less**. The encoded
vector is a uint8 tensor that hivemind's all-reduce splits on record boundaries (its parts are a whole
number of records). The reducer of a span decodes every sender's records (refusing malformed ones:
cotrain.hivemind_ext.reducers), averages them densely, and encodes the average again with the same codec:
every peer of the group receives the same bytes for the span and decodes the same update, so the replicas stay
bit-identical. The average of n sparse contributions holds up to n k values per chunk; what its re-encoding
leaves out stays with the reducer, in its own error-feedback buffer (scaled by the number of senders, so that
the next round's average carries it again), as a server's residual in two-sided error compensation
(DoubleSqueeze, Tang et al., 2019).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BITS = (2, 4, 8)  # the bits per value a codec can send (the run config checks --topk-bits against the same)
CHUNK = 4096  # values per chunk
# chunks encoded or decoded at a time: temporaries of a few MB, which the allocator reuses (one of the whole
# vector would be fresh memory at every round, hundreds of MB whose pages the kernel zeroes each time)
BLOCK = 256


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(m, 8n) zeros and ones as (m, n) bytes, the first bit the lowest of the first byte."""
    weights = 1 << torch.arange(8, dtype=torch.int32)
    return (bits.reshape(bits.shape[0], -1, 8).to(torch.int32) * weights).sum(dim=2).to(torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """The (m, 8n) bits (int64 zeros and ones) of (m, n) bytes, as ``pack_bits`` wrote them."""
    shifts = torch.arange(8, dtype=torch.int64)
    return ((data.to(torch.int64)[..., None] >> shifts) & 1).reshape(data.shape[0], -1)


def low_bits(chunk: int, k: int) -> int:
    """Elias-Fano's low bits per index of ``k`` among ``chunk`` values: log2(chunk / k), rounded down."""
    return max(0, (chunk // k).bit_length() - 1)


def upper_bytes(chunk: int, k: int) -> int:
    """Bytes of Elias-Fano's unary high parts: one bit per index and one per value of the high part."""
    return math.ceil((k + ((chunk - 1) >> low_bits(chunk, k)) + 1) / 8)


def pack_indices(index: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sorted indices below ``chunk``, (m, k) with k a multiple of 8, in Elias-Fano form (uint8, (m,
    upper_bytes + k L / 8)): the high parts in unary (index i's bit at its high part + i), then the low
    parts."""
    m, k = index.shape
    low = low_bits(chunk, k)
    upper = torch.zeros(m, 8 * upper_bytes(chunk, k), dtype=torch.int64)
    upper.scatter_(1, (index >> low) + torch.arange(k), 1)
    lows = (index[..., None] >> torch.arange(low)) & 1
    return torch.cat([pack_bits(upper), pack_bits(lows.reshape(m, k * low))], dim=1)


def unpack_indices(data: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (m, k) int64 indices that ``pack_indices`` wrote into ``data``, and how many high-part bits each
    row holds (k in a valid one: the indices read from a row of any other count are meaningless)."""
    m, low, head = data.shape[0], low_bits(chunk, k), upper_bytes(chunk, k)
    upper = unpack_bits(data[:, :head])
    # the positions of the set bits, in order: a stable sort puts the ones first
    ones = torch.sort(upper, dim=1, descending=True, stable=True).indices[:, :k]
    high = ones - torch.arange(k)
    weights = 1 << torch.arange(low, dtype=torch.int64)
    lows = (unpack_bits(data[:, head:]).reshape(m, k, low) * weights).sum(dim=2)
    return (high << low) | lows, upper.sum(dim=1)


@dataclass(frozen=True)
class TopK:
    """The codec: ``density`` of each chunk kept, quantized to ``bits`` bits; a peer's error-feedback buffer
    joins its next round's change times ``decay`` (what stays unsent fades)."""

    density: float = 1 / 64
    bits: int = 2
    chunk: int = CHUNK
    decay: float = 1.0

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"topk bits must be one of {BITS}, got {self.bits}")
        if not 0 < self.density <= 0.5:
            raise ValueError(f"topk density must be in (0, 0.5], got {self.density}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"topk feedback decay must be in (0, 1], got {self.decay}")
        if not 8 <= self.chunk <= CHUNK:
            raise ValueError(f"chunk must be between 8 and {CHUNK} values, got {self.chunk}")

    @property
    def k(self) -> int:
        """Values kept per chunk: the density's share, rounded to a multiple of 8 (whole bytes of codes)."""
        return min(self.chunk, max(8, 8 * round(self.density * self.chunk / 8)))

    @property
    def index_bytes(self) -> int:
        """Bytes of a chunk's indices (Elias-Fano)."""
        return upper_bytes(self.chunk, self.k) + self.k * low_bits(self.chunk, self.k) // 8

    @property
    def record(self) -> int:
        """Bytes per chunk: indices, packed codes, low and high levels."""
        return self.index_bytes + self.k * self.bits // 8 + 4

    def chunks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.chunk))

    def encoded_size(self, numel: int) -> int:
        """Bytes of the encoded form of ``numel`` values."""
        return self.chunks(numel) * self.record

    @property
    def levels(self) -> torch.Tensor:
        """Where each magnitude code puts its value between ``low`` (0) and ``high`` (1): quadratic steps."""
        n = 1 << (self.bits - 1)
        return torch.tensor([(t / (n - 1)) ** 2 for t in range(n)], dtype=torch.float32)

    def bounds(self, magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high) per row of the kept ``magnitudes`` (m, k), rounded to bfloat16 (the module's doc)."""
        low, high = magnitudes.amin(dim=1), magnitudes.amax(dim=1)
        if self.bits == 2:  # the means below and above the midpoint; 0 where a kept value is 0
            upper = magnitudes > ((low + high) / 2)[:, None]
            above = upper.sum(dim=1)
            high = torch.where(above > 0, (magnitudes * upper).sum(dim=1) / above.clamp(min=1), high)
            # the values below: never none (the smallest is at most the midpoint)
            below = (magnitudes * ~upper).sum(dim=1) / (self.k - above).clamp(min=1)
            low = torch.where(low > 0, below, torch.zeros_like(below))
        return low.to(torch.bfloat16).float(), high.to(torch.bfloat16).float()

    def magnitudes(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """The (m, 2**(bits-1)) magnitudes of each chunk's codes."""
        return low[:, None] + (high - low)[:, None] * self.levels

    # --- encoding -----------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The records (uint8) of the flat float ``values`` (padded with zeros to whole chunks), encoded
        ``BLOCK`` chunks at a time (each chunk's record depends on that chunk alone)."""
        flat = values.detach().reshape(-1).float().cpu()
        m, c = self.chunks(flat.numel()), self.chunk
        out = torch.empty(m, self.record, dtype=torch.uint8)
        for start in range(0, m, BLOCK):
            stop = min(m, start + BLOCK)
            out[start:stop] = self._encode_rows(_rows(flat, start, stop, c))
        return out.reshape(-1)

    def _encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The (m, record) records of the (m, chunk) ``rows``."""
        m, k, c = rows.shape[0], self.k, self.chunk
        index = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = rows.gather(1, index)
        low, high = self.bounds(kept.abs())
        table = self.magnitudes(low, high)
        midpoints = ((table[:, 1:] + table[:, :-1]) / 2).contiguous()
        nearest = torch.searchsorted(midpoints, kept.abs().contiguous()).to(torch.int32)
        codes = nearest | ((kept < 0).to(torch.int32) << (self.bits - 1))
        per = 8 // self.bits
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        packed = (codes.view(m, k // per, per) << shifts).sum(dim=2).to(torch.uint8)
        index_bytes = pack_indices(index, c)
        bounds = torch.stack([low, high], dim=1).to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat([index_bytes, packed, bounds.view(m, 4)], dim=1)

    def _fields(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices (m, k) int64, codes (m, k) int32, (low, high) (m, 2) float32, set high-part bits per
        record (k in a valid one)) of whole records."""
        m, k, at = data.numel() // self.record, self.k, self.index_bytes
        rows = data.reshape(m, self.record)
        index, counts = unpack_indices(rows[:, :at], self.chunk, k)
        per = 8 // self.bits
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        packed = rows[:, at : at + k // per].to(torch.int32)
        codes = ((packed[..., None] >> shifts) & ((1 << self.bits) - 1)).reshape(m, k)
        bounds = rows[:, -4:].contiguous().view(torch.bfloat16).float().reshape(m, 2)
        return index, codes, bounds, counts

    def problem(self, data: torch.Tensor) -> str:
        """Why ``data`` is not a valid encoding (an empty string when it is): its type or length, a chunk
        with more or fewer than k indices, indices out of range or not strictly increasing (a repeated
        index), a low or high level that is negative, NaN or infinite, or a low level above the high one."""
        if data.dtype != torch.uint8 or data.dim() != 1:
            return f"a sparse part of dtype {data.dtype} and {data.dim()} dimension(s) (expected uint8, 1)"
        if data.numel() % self.record:
            return f"a sparse part of {data.numel()} bytes (not a whole number of {self.record}-byte records)"
        if not data.numel():
            return ""
        index, _, bounds, counts = self._fields(data)
        if not bool((counts == self.k).all()):
            return f"a chunk with other than {self.k} indices"
        if int(index.max()) >= self.chunk:
            return f"an index beyond the chunk of {self.chunk}"
        if self.k > 1 and not bool((index[:, 1:] > index[:, :-1]).all()):
            return "indices not strictly increasing within a chunk"
        if not bool((torch.isfinite(bounds) & (bounds >= 0)).all()):
            return "a negative, NaN or infinite scale (a low or high level)"
        if not bool((bounds[:, 0] <= bounds[:, 1]).all()):
            return "a scale's low level above its high one"
        return ""

    @torch.no_grad()
    def decode(self, data: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """The dense float32 values of valid records (``numel`` of them; default: whole chunks)."""
        m = data.numel() // self.record
        out = torch.zeros(m * self.chunk if numel is None else numel)
        self.add_decoded(data, out)
        return out

    @torch.no_grad()
    def add_decoded(self, data: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> None:
        """Add ``alpha`` times the values of valid records to the flat float32 ``out`` (the values beyond
        its length dropped), ``BLOCK`` chunks at a time: no dense copy of the whole vector."""
        m, c = data.numel() // self.record, self.chunk
        rows = data.reshape(m, self.record)
        for start in range(0, min(m, math.ceil(out.numel() / c)), BLOCK):
            stop = min(m, start + BLOCK)
            index, values = self._decode_rows(rows[start:stop])
            lo, hi = start * c, min(stop * c, out.numel())
            if hi - lo == (stop - start) * c:
                out[lo:hi].view(stop - start, c).scatter_add_(1, index, values.mul_(alpha))
            else:  # the last, partial chunk
                dense = torch.zeros(stop - start, c)
                dense.scatter_(1, index, values.mul_(alpha))
                out[lo:hi].add_(dense.reshape(-1)[: hi - lo])

    def largest(self, data: torch.Tensor) -> float:
        """The largest magnitude that valid records ``data`` decode to (their largest high level)."""
        return float(self._fields(data)[2][:, 1].max()) if data.numel() else 0.0

    def _decode_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, float32 values), each (m, k), of the (m, record) records ``rows``."""
        index, codes, bounds, _ = self._fields(rows.reshape(-1))
        table = self.magnitudes(bounds[:, 0], bounds[:, 1])
        values = table.gather(1, (codes & ((1 << (self.bits - 1)) - 1)).long())
        return index, torch.where(codes >> (self.bits - 1) == 1, -values, values)


@dataclass(frozen=True)
class Raw:
    """Float32 values as their bytes: the outer state of a sparse swarm's rounds (where lineages differ),
    which the reducer averages and every member then takes as the same bytes
    (cotrain.hivemind_ext.reducers)."""

    record: int = 4

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.detach().reshape(-1).float().cpu().contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        flat = data.contiguous().view(torch.float32)
        return flat if numel is None else flat[:numel]

    def add_decoded(self, data: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> None:
        """Add ``alpha`` times the values of ``data`` to the flat float32 ``out`` (no copy: a view)."""
        out.add_(self.decode(data, out.numel()), alpha=alpha)

    def largest(self, data: torch.Tensor) -> float:
        return float(self.decode(data).abs().max()) if data.numel() else 0.0

    def problem(self, data: torch.Tensor) -> str:
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4:
            return f"a part of {data.numel()} {data.dtype} values (expected whole float32 values as bytes)"
        if not bool(torch.isfinite(self.decode(data)).all()):
            return "NaN or Inf"
        return ""


def flat(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensors`` as one flat vector, in their order (what a codec encodes), written to ``out`` if given."""
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


def _rows(flat: torch.Tensor, start: int, stop: int, chunk: int) -> torch.Tensor:
    """Chunks ``start`` to ``stop`` of ``flat`` as (stop - start, chunk) rows, the last padded with zeros."""
    lo, hi = start * chunk, min(stop * chunk, flat.numel())
    if hi - lo == (stop - start) * chunk:
        return flat[lo:hi].view(stop - start, chunk)
    rows = torch.zeros(stop - start, chunk)
    rows.view(-1)[: hi - lo] = flat[lo:hi]
    return rows
