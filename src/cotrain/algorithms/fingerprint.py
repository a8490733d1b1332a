"""A state's fingerprint and the vote on it: values sampled at positions every peer derives alike, their
distances, the verdict on a downloaded state against the records of other peers, and whether they attest the
DiLoCo lineage its donor served with it. The module doc of cotrain.hivemind_ext.statecheck explains the
scheme; this module holds its arithmetic, with no network."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import statistics
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

SAMPLES_PER_TENSOR = 8  # sampled values per tensor: 36 bytes per tensor in a record, with its norm
# The largest distance (see the module's doc) at which two fingerprints count as the same state. Measured on
# live swarms of 3 trainers and a monitor on 127.0.0.1 (albert-tiny, fp16 averaging), between the records of
# every pair of peers at the same step: sync 2e-4 to 6e-4, and up to 4e-3 for a peer whose first gradient
# rounds found no group (it stepped alone); DiLoCo (--local-steps 3, 43 rounds, all averaged by the 3) 1e-3
# to 1.5e-2; the monitor's copy 0. A poisoned state is at ~1 or more (random values of the same norm: ~1.4;
# a sign flip: 2; zeros: 1; a scale by s: |s - 1| / max(s, 1), 0.33 for s = 1.5). 0.1 is ~7x the largest
# honest distance and a third of the smallest poison above.
TOLERANCE = 0.1
# Where honest peers' states are spread (``spread``), records within SPREAD_FACTOR x that spread agree.
# Measured with 16 trainers in groups of 4 (benchmarks/scale.py): honest peers at the same step 0.16 to 1.9
# apart, each holding a state of its own (zero-initialized biases, moved in each group's own direction, differ
# by O(1)).
SPREAD_FACTOR = 2.0
MAX_VOTERS = 64  # records compared per download (a random sample beyond): the vote is quadratic in them
SCALE_FLOOR = 1e-6  # typical values below this count as this (a tensor of zeros against one of ~1e-9 agree)


# --- the fingerprint ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """A state's fingerprint at one global step: per tensor its size, its norm and sampled values."""

    epoch: int
    numels: tuple[int, ...]
    norms: torch.Tensor  # float64, one per tensor
    samples: torch.Tensor  # float64, tensors x SAMPLES_PER_TENSOR

    @property
    def layout(self) -> str:
        """A short hash of the tensors' sizes: records of another model are not compared."""
        return layout_hash(self.numels)

    def to_bytes(self) -> bytes:
        values = torch.cat([self.norms.reshape(-1), self.samples.reshape(-1)]).to(torch.float32)
        return values.numpy().tobytes()

    @classmethod
    def from_bytes(cls, epoch: int, numels: Sequence[int], data: bytes) -> Fingerprint:
        n = len(numels)
        values = torch.frombuffer(bytearray(data), dtype=torch.float32).to(torch.float64)
        if values.numel() != n * (1 + SAMPLES_PER_TENSOR):
            raise ValueError(f"a fingerprint of {n} tensors has {n * (1 + SAMPLES_PER_TENSOR)} values")
        return cls(epoch, tuple(numels), values[:n], values[n:].reshape(n, SAMPLES_PER_TENSOR))


def layout_hash(numels: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, numels)).encode()).hexdigest()[:16]


def positions(epoch: int, index: int, numel: int) -> torch.Tensor:
    """The sampled positions of tensor ``index`` at step ``epoch``: the same on every peer, new every step."""
    seed = int.from_bytes(hashlib.sha256(f"cotrain-state:{epoch}:{index}".encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(max(numel, 1), (SAMPLES_PER_TENSOR,), generator=generator)


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat if flat.is_floating_point() else flat.double()


@torch.no_grad()
def sampled_values(tensors: Sequence[torch.Tensor], epoch: int) -> torch.Tensor:
    """The values at the sampled positions of each tensor at step ``epoch`` (tensors x SAMPLES_PER_TENSOR,
    float64 on the CPU): the cheap part of a fingerprint."""
    rows = []
    for i, t in enumerate(tensors):
        flat = _flat(t)
        if flat.numel() == 0:
            rows.append(torch.zeros(SAMPLES_PER_TENSOR, dtype=torch.float64, device=flat.device))
        else:
            rows.append(flat[positions(epoch, i, flat.numel()).to(flat.device)].to(torch.float64))
    return torch.stack(rows).cpu() if rows else torch.zeros(0, SAMPLES_PER_TENSOR, dtype=torch.float64)


@torch.no_grad()
def fingerprint(
    tensors: Sequence[torch.Tensor], epoch: int, samples: torch.Tensor | None = None
) -> Fingerprint:
    """The fingerprint of ``tensors`` (on any device, in any floating dtype) at step ``epoch`` (``samples``:
    their ``sampled_values``, when already taken)."""
    norms = []
    for t in tensors:
        flat = _flat(t)
        # fp32 accumulation is ample for a tolerance of TOLERANCE, and needs no float64 copy of the tensor
        wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
        norms.append(torch.linalg.vector_norm(flat, dtype=wide).to(torch.float64))
    samples = sampled_values(tensors, epoch) if samples is None else samples
    norms_ = torch.stack(norms).cpu() if norms else torch.zeros(0, dtype=torch.float64)
    return Fingerprint(epoch, tuple(t.numel() for t in tensors), norms_, samples)


def distance(a: Fingerprint, b: Fingerprint) -> float:
    """How far apart two states are, in units of each tensor's typical value (the largest over tensors of
    the relative difference of norms and of the sampled values' RMS difference over the tensor's RMS);
    infinite for different layouts or non-finite values."""
    if a.numels != b.numels:
        return math.inf
    if not a.numels:
        return 0.0
    sizes = torch.tensor(a.numels, dtype=torch.float64).clamp(min=1).sqrt()
    scale = torch.maximum(a.norms.abs(), b.norms.abs()) / sizes
    scale = scale.clamp(min=SCALE_FLOOR)
    of_norms = (a.norms - b.norms).abs() / sizes / scale
    of_samples = (a.samples - b.samples).pow(2).mean(dim=1).sqrt() / scale
    worst = torch.maximum(of_norms, of_samples).max().item()
    return worst if math.isfinite(worst) else math.inf


# --- the verdict ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """Whether a downloaded state is loaded: ``kind`` is "verified", "refuted" or "unverifiable"; ``agree``
    of ``total`` records for its step match it; ``nearest``: its distance to the nearest other peer's."""

    kind: str
    agree: int = 0
    total: int = 0
    nearest: float = math.inf
    tolerance: float = TOLERANCE  # the distance within which records agreed (``verdict``)
    rivals: int = 0  # the largest group of records that agree on another state
    trusted: str = ""  # who decided instead of the count (``weigh_trusted``): "initial peer", "own record"

    @property
    def accepted(self) -> bool:
        return self.kind == "verified"


def verdict(
    state: Fingerprint,
    records: Mapping[Hashable, Fingerprint],
    donor: Collection[Hashable] = (),
    tolerance: float = TOLERANCE,
) -> Verdict:
    """Judge the fingerprint of a state that a donor served against ``records``, the fingerprints published
    for its step (one per signing key; the downloader's own left out); ``donor``: the keys of the records that
    name the donor. See the module's doc."""
    if len(records) > MAX_VOTERS:  # a sample of the voters, the donor's own records kept
        candidates = sorted(k for k in records if k not in donor)
        others = random.sample(candidates, min(len(candidates), MAX_VOTERS - 1))
        records = {k: records[k] for k in records if k in donor or k in others}
    if all(k in donor for k in records):
        return Verdict("unverifiable", len(records), len(records))
    tolerance = max(tolerance, SPREAD_FACTOR * spread([fp for k, fp in records.items() if k not in donor]))
    distances = {k: distance(state, fp) for k, fp in records.items()}
    agree = {k for k, d in distances.items() if d <= tolerance}
    nearest = min(d for k, d in distances.items() if k not in donor)
    # the largest group of records that agree with a state this one is not, among the records that do not
    # agree with this one (agreement is not transitive: a record between two states agrees with both)
    outside = [fp for k, fp in records.items() if k not in agree]
    rivals = max((sum(distance(r, fp) <= tolerance for fp in outside) for r in outside), default=0)
    # a rival group refutes a state another peer vouches for only where it is larger and a strict majority
    ok = any(k not in donor for k in agree) and (len(agree) >= rivals or 2 * rivals <= len(records))
    return Verdict("verified" if ok else "refuted", len(agree), len(records), nearest, tolerance, rivals)


def weigh_trusted(
    found: Verdict,
    state: Fingerprint,
    anchors: Sequence[Fingerprint] = (),
    own: Sequence[Fingerprint] = (),
    donor_is_anchor: bool = False,
) -> Verdict:
    """``found`` (``verdict``'s judgement by count) weighed by the records no count of keys can outvote: those
    of the initial peer the user was told to join (``anchors``: the address is what the user vouched for) and
    the downloader's own earlier ones (``own``). A state served by the initial peer itself, or that one of
    these records matches within ``found.tolerance``, is verified; one that the initial peer's records all
    miss is refuted, however many other keys vouch for it. The downloader's own records only ever vouch:
    after a partition its own state at a step is not the swarm's. Without such records, ``found`` stands."""
    if donor_is_anchor:  # its own state: no distance to tell
        return dataclasses.replace(found, kind="verified", nearest=math.inf, trusted="initial peer")
    if anchors:
        near = min(distance(state, fp) for fp in anchors)
        kind = "verified" if near <= found.tolerance else "refuted"
        return dataclasses.replace(found, kind=kind, nearest=near, trusted="initial peer")
    if own and found.kind != "verified":
        near = min(distance(state, fp) for fp in own)
        if near <= found.tolerance:
            return dataclasses.replace(found, kind="verified", nearest=near, trusted="own record")
    return found


def spread(fingerprints: Sequence[Fingerprint]) -> float:
    """How far apart honest peers' states are at a step: the median, over the fingerprints, of the distance
    from each to its nearest other one (0 for fewer than 3). Near 0 when peers averaged together, even in
    separate groups (each has a near twin); large when every peer holds a state of its own, as in a swarm of
    small averaging groups whose members' parameters mix through changing groups. A minority of liars' records
    cannot move the median."""
    if len(fingerprints) < 3:
        return 0.0
    nearest = [
        min(distance(a, b) for j, b in enumerate(fingerprints) if j != i) for i, a in enumerate(fingerprints)
    ]
    return statistics.median(nearest)


# --- a lineage's attestation (DiLoCo) -------------------------------------------------------------------


@dataclass(frozen=True)
class Attestation:
    """What a DiLoCo holder's record says of its state at a step beyond its fingerprint: the lineage it
    vouches for there (cotrain.algorithms.lineage.Voucher), and the fingerprint of its outer momentum (None in
    a run without momentum)."""

    lineage: bytes
    momentum: Fingerprint | None


def lineage_attested(
    lineage: bytes,
    state: Fingerprint,
    momentum: Fingerprint | None,
    others: Sequence[tuple[Fingerprint, Attestation]],
    tolerance: float = TOLERANCE,
) -> bool:
    """Whether a downloaded state may keep the ``lineage`` its donor served it with: peers of a lineage hold
    the same outer state (global parameters and momentum, to the rounding of their averages), so the state
    (``state``: its global parameters' fingerprint; ``momentum``: its momentum's) must match, within
    ``tolerance``, the fingerprints of every other peer whose record (``others``: fingerprint and
    attestation, for the state's step, never the donor's) attests that lineage, and at least one must. The
    donor's word alone does not do: the momentum is in no other check, and a round among peers of one lineage
    never averages it."""
    claims = [(fp, attested) for fp, attested in others if attested.lineage == lineage]
    if not claims:
        return False
    for fp, attested in claims:
        if distance(state, fp) > tolerance or (momentum is None) != (attested.momentum is None):
            return False
        if momentum is not None and distance(momentum, attested.momentum) > tolerance:
            return False
    return True
