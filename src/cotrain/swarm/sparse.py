"""DiLoCo's sparse rounds: the pseudo-gradient as the top-k values of each chunk, quantized, with error
feedback.

``--outer-compression topk`` (swarm-wide: it changes the math). Each peer adds its error-feedback buffer to
its round's pseudo-gradient, splits the sum into chunks of ``CHUNK`` values, keeps the ``k`` of largest
magnitude in each (``k``: ``--topk-density`` of the chunk, a multiple of 8), quantizes them to ``--topk-bits``
bits with a per-chunk scale (the largest kept magnitude; levels spread evenly over [-scale, scale]), and keeps
what it did not send (the values left out and the rounding of those sent) in its buffer for the next round.

A chunk travels as one fixed-size record: ``k`` indices within the chunk (12 bits each, two to three bytes,
strictly increasing), the ``k`` codes packed ``8 // bits`` to a byte, and the scale (float32): ``3k / 2 + k *
bits / 8 + 4`` bytes against ``2 * CHUNK`` in fp16 (at the defaults, k = 64 of 4096 at 2 bits: 116 bytes, 70x
less). The encoded vector is a uint8 tensor that hivemind's all-reduce splits on record boundaries (its parts
are a whole number of records). The reducer of a span decodes every sender's records (refusing malformed ones:
cotrain.swarm.robust), averages them densely, and encodes the average again with the same codec: every peer of
the group receives the same bytes for the span and decodes the same update, so the replicas stay
bit-identical. The average of n sparse contributions holds up to n k values per chunk; what its re-encoding
leaves out stays with the reducer, in its own error-feedback buffer (scaled by the number of senders, so that
the next round's average carries it again), as a server's residual in two-sided error compensation
(DoubleSqueeze, Tang et al., 2019).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS = (2, 4, 8)  # the bits per value a codec can send (the run config checks --topk-bits against the same)
CHUNK = 4096  # values per chunk (indices within a chunk fit 12 bits)


def pack_indices(index: torch.Tensor) -> torch.Tensor:
    """Indices below 4096, (m, k) with k even, as 12 bits each: every two of them in three bytes (uint8, (m,
    3k / 2))."""
    i = index.to(torch.int32)
    first, second = i[:, 0::2], i[:, 1::2]
    packed = torch.stack([first & 0xFF, (first >> 8) | ((second & 0xF) << 4), second >> 4], dim=2)
    return packed.reshape(i.shape[0], -1).to(torch.uint8)


def unpack_indices(data: torch.Tensor) -> torch.Tensor:
    """The (m, k) int64 indices that ``pack_indices`` wrote into ``data`` (uint8, (m, 3k / 2))."""
    t = data.reshape(data.shape[0], -1, 3).to(torch.int64)
    first = t[..., 0] | ((t[..., 1] & 0xF) << 8)
    second = (t[..., 1] >> 4) | (t[..., 2] << 4)
    return torch.stack([first, second], dim=2).reshape(data.shape[0], -1)


@dataclass(frozen=True)
class TopK:
    """The codec: ``density`` of each chunk kept, quantized to ``bits`` bits."""

    density: float = 1 / 64
    bits: int = 2
    chunk: int = CHUNK

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"topk bits must be one of {BITS}, got {self.bits}")
        if not 0 < self.density <= 0.5:
            raise ValueError(f"topk density must be in (0, 0.5], got {self.density}")
        if not 8 <= self.chunk <= CHUNK:
            raise ValueError(f"chunk must be between 8 and {CHUNK} values, got {self.chunk}")

    @property
    def k(self) -> int:
        """Values kept per chunk: the density's share, rounded to a multiple of 8 (whole bytes of codes)."""
        return min(self.chunk, max(8, 8 * round(self.density * self.chunk / 8)))

    @property
    def record(self) -> int:
        """Bytes per chunk: indices (12 bits each), packed codes, scale."""
        return 3 * self.k // 2 + self.k * self.bits // 8 + 4

    def chunks(self, numel: int) -> int:
        return max(1, math.ceil(numel / self.chunk))

    def encoded_size(self, numel: int) -> int:
        """Bytes of the encoded form of ``numel`` values."""
        return self.chunks(numel) * self.record

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    # --- encoding -----------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The records (uint8) of the flat float ``values`` (padded with zeros to whole chunks)."""
        flat = values.detach().reshape(-1).float().cpu()
        m, k, c = self.chunks(flat.numel()), self.k, self.chunk
        padded = torch.zeros(m * c)
        padded[: flat.numel()] = flat
        rows = padded.view(m, c)
        index = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = rows.gather(1, index)
        scale = kept.abs().amax(dim=1)
        unit = kept / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        codes = ((unit + 1) * (self.levels / 2)).round().clamp(0, self.levels).to(torch.int32)
        per = 8 // self.bits
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        packed = (codes.view(m, k // per, per) << shifts).sum(dim=2).to(torch.uint8)
        index_bytes = pack_indices(index)
        scale_bytes = scale.contiguous().view(torch.uint8).view(m, 4)
        return torch.cat([index_bytes, packed, scale_bytes], dim=1).reshape(-1)

    def _fields(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indices (m, k) int64, codes (m, k) int32, scales (m,) float32) of whole records."""
        m, k = data.numel() // self.record, self.k
        rows = data.reshape(m, self.record)
        index = unpack_indices(rows[:, : 3 * k // 2])
        per = 8 // self.bits
        shifts = torch.arange(per, dtype=torch.int32) * self.bits
        packed = rows[:, 3 * k // 2 : 3 * k // 2 + k // per].to(torch.int32)
        codes = ((packed[..., None] >> shifts) & self.levels).reshape(m, k)
        scale = rows[:, -4:].contiguous().view(torch.float32).reshape(m)
        return index, codes, scale

    def problem(self, data: torch.Tensor) -> str:
        """Why ``data`` is not a valid encoding (an empty string when it is): its type or length, indices out
        of range or not strictly increasing (a repeated index), a scale that is negative, NaN or infinite."""
        if data.dtype != torch.uint8 or data.dim() != 1:
            return f"a sparse part of dtype {data.dtype} and {data.dim()} dimension(s) (expected uint8, 1)"
        if data.numel() % self.record:
            return f"a sparse part of {data.numel()} bytes (not a whole number of {self.record}-byte records)"
        if not data.numel():
            return ""
        index, _, scale = self._fields(data)
        if int(index.max()) >= self.chunk:
            return f"an index beyond the chunk of {self.chunk}"
        if self.k > 1 and not bool((index[:, 1:] > index[:, :-1]).all()):
            return "indices not strictly increasing within a chunk"
        if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
            return "a negative, NaN or infinite scale"
        return ""

    @torch.no_grad()
    def decode(self, data: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """The dense float32 values of valid records (``numel`` of them; default: whole chunks)."""
        m = data.numel() // self.record
        index, codes, scale = self._fields(data)
        values = (codes.float() * (2 / self.levels) - 1) * scale[:, None]
        rows = torch.zeros(m, self.chunk)
        rows.scatter_(1, index, values)
        flat = rows.reshape(-1)
        return flat if numel is None else flat[:numel]


@dataclass(frozen=True)
class Raw:
    """Float32 values as their bytes: the outer state of a sparse swarm's rounds (where lineages differ),
    which the reducer averages and every member then takes as the same bytes (cotrain.swarm.robust)."""

    record: int = 4

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.detach().reshape(-1).float().cpu().contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        flat = data.contiguous().view(torch.float32)
        return flat if numel is None else flat[:numel]

    def problem(self, data: torch.Tensor) -> str:
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() % 4:
            return f"a part of {data.numel()} {data.dtype} values (expected whole float32 values as bytes)"
        if not bool(torch.isfinite(self.decode(data)).all()):
            return "NaN or Inf"
        return ""


def codec_of(outer_compression: str, density: float, bits: int) -> TopK | None:
    """The codec of a run's ``outer_compression`` (None: dense rounds)."""
    return TopK(density=density, bits=bits) if outer_compression == "topk" else None
