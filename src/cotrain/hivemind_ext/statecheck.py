"""State downloads that a malicious donor cannot poison: signed fingerprints of the served state, checked by
every downloader.

Every state holder (a trainer's state averager, sync or DiLoCo, and the monitor's and evaluation peer's copy)
publishes, under ``{run_id}_state_averager_fingerprints`` and its own RSA public key as subkey (signed like
the metrics records), a fingerprint of the parameters it holds (the model's parameters and extra tensors,
DiLoCo's global parameters) for each of its last ``HISTORY`` global steps. A downloader computes the same
fingerprint of the state a donor sent and checks it against the records published for that step before
loading it; a donor whose state differs is named in one log line, tried last for ``SUSPECT_SECONDS``, and the
next donor is asked, until the download's timeout. A donor that cannot be reached (no connection, or no first
message, within ``OPEN_TIMEOUT``: a peer behind NAT that announced an address nobody can dial) is tried last
for ``UNREACHABLE_SECONDS``, so a newcomer's next try goes to a donor it can reach (the monitor keeps the
state) instead of waiting on the same dial again (cotrain.algorithms.donors).

The fingerprint. Honest peers do not hold bit-identical parameters at the same step: the averaged gradients
(sync) or pseudo-gradients (DiLoCo) and the averaged parameters reach each peer in fp16 with its own rounding,
and a peer whose averaging round failed took its step with local values. An exact hash would tell every pair
of honest peers apart. The fingerprint is instead, for each tensor, its norm and the values at
``SAMPLES_PER_TENSOR`` pseudo-random positions (drawn from the step and the tensor's index, the same on every
peer). Two fingerprints are compared tensor by tensor in units of the tensor's typical value (its norm over
the square root of its size, ``rms``): the distance is the largest, over tensors, of the relative difference
of the norms and of the root-mean-square difference of the sampled values over the rms. A poisoned state
(random values, even of the same norm; a sign flip; a scale) is at distance ~1; honest peers that averaged
together are within ``TOLERANCE`` (measured, see its comment).

Which records count, and when a state is loaded (``verdict``):
- Each record is one vote (one per signing key); a record that names the donor's peer id is the donor's
  own, and the downloader's own records are left out.
- A state at step E is *verified* when the records for E that match it include another peer's than the
  donor's, and no group of records that match another state is both larger and a strict majority of the
  records for E: loaded. Not "the largest group", because honest peers do split: DiLoCo peers whose round
  failed, or two groups that averaged apart, hold different global parameters at the same round (measured:
  distances of 0.05 to 2 on small tensors) until their next round averages the outer state; and in a swarm
  of small averaging groups (16 trainers in groups of 4) each group's members agree with each other and
  with no other group, so the records for a step form several groups of a few, of changing sizes (a newcomer
  there refused honest donors whose state matched another peer's record to 5e-4, because another group
  had more records).
- Records agree within ``TOLERANCE``, or within ``SPREAD_FACTOR`` x the records' ``spread`` where that is
  larger: in a swarm of small averaging groups (``--target-group-size`` below the swarm's size) honest peers
  each hold a state of their own at a step, as far apart as some poisons; a state is then checked only
  against what honest peers' own differences allow (a sign flip or garbage farther than that is refuted).
- It is *refuted* when records of other peers for E exist and it fails that test: not loaded, the donor is
  named and tried last for a while, and the next donor is asked. One honest peer against one liar is a tie
  that nobody can break: neither state is loaded.
- It is *unverifiable* when no peer other than the donor published a record for E (a swarm of peers that
  publish none, a single trainer beside a monitor at an older step): loaded with an info line, unless a
  donor whose declared step others did vouch for is still left to ask. Donors are asked in this order:
  suspects last; first those whose declared step (their priority) is ahead of the downloader's own step;
  among those, the ones whose step has a record of another peer first, then by priority. So a donor that
  claims a step nobody else holds is only asked when no vouched-for donor ahead of the downloader serves;
  and a vouched-for donor that is not ahead cannot keep it behind: after a partition, the trainers that went
  on training hold steps that only their own records vouch for, while the older step the cut-off peer
  already holds is vouched for by everyone (``donor_order``). With robust aggregation, a donor whose step is
  beyond the one that two other full peers' progress records reached is not asked while a donor within it
  serves (``within_witnessed``): a lone liar that runs ahead would otherwise hand its epoch to every
  newcomer, which would then vouch for it as the second witness of cotrain.hivemind_ext.progress.
The monitor's record is one vote like any other: a record cannot prove that it comes from the monitor (in a
public swarm anyone can run one). A peer that loaded nothing retries at its next step, as it is still behind.
This assumes that most record publishers for a step are honest, and that where they agree (one state holds
a strict majority of the records) colluding liars are outvoted; where honest peers split into several groups
without a majority, one liar is still refuted (no other record vouches for its state) but two that publish
the same poisoned fingerprint are not. One attacker with many keys (Sybil) can outvote honest peers, as in
any vote; a private swarm's tokens (cotrain.access) bound who can publish at all. An
attacker that knows the sampled positions can also craft a state that matches the fingerprint while it
differs elsewhere (keeping every tensor's norm): the check stops a peer that serves garbage, scaled or
sign-flipped parameters, not a state crafted against it. Optimizer statistics are not checked: DiLoCo's inner
statistics differ between honest peers by design, and sync's are not averaged. A donor's stream is counted as
it comes against the most a state of the downloader's model can hold (``state_bound``;
cotrain.algorithms.statelimit): more tensors or bytes than that and it is refused, and the next donor asked.

A holder's record may say more of a step than its fingerprint (``attestation``): a DiLoCo trainer's names the
lineage it vouches for there, with a fingerprint of its outer momentum, and a downloader keeps the lineage a
donor served only where another peer's record attests it for that state (``settle_download``). Before a
state is judged, a holder may refuse it outright (``served_refusal``: DiLoCo's round beyond the step that the
progress records under ``witnessed_key`` witness, or an inner step outside its round), as it refuses a state
that is not finite; both are cotrain.hivemind_ext.diloco_state's.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import deserialize_torch_tensor
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration
from pydantic.v1 import BaseModel, conbytes, confloat, conint, conlist, constr, root_validator

from cotrain.access.voters import one_vote_each, voters_of
from cotrain.algorithms.donors import (
    SUSPECT_SECONDS,
    UNREACHABLE_SECONDS,
    DonorUnreachable,
    chained,
    donor_order,
    opened,
    within_witnessed,
)
from cotrain.algorithms.fingerprint import (  # noqa: F401 (re-exported)
    MAX_VOTERS,
    SAMPLES_PER_TENSOR,
    SCALE_FLOOR,
    SPREAD_FACTOR,
    TOLERANCE,
    Attestation,
    Fingerprint,
    Verdict,
    distance,
    fingerprint,
    layout_hash,
    positions,
    sampled_values,
    spread,
    verdict,
    weigh_trusted,
)
from cotrain.algorithms.lineage import LINEAGE_BYTES
from cotrain.algorithms.statelimit import StateBudget, StateTooLarge, state_bound
from cotrain.faults import PoisonedState
from cotrain.hivemind_ext.direct import DirectTransport
from cotrain.hivemind_ext.hooks import Averager
from cotrain.hivemind_ext.hosting import ServedInThread, join_at_exit
from cotrain.hivemind_ext.liveness import WatchedRounds
from cotrain.hivemind_ext.progress import WITNESSES, witnessed_epoch
from cotrain.keys import fingerprints_key, state_averager_prefix

logger = logging.getLogger(__name__)

HISTORY = 3  # steps each record keeps: a downloader checks a step its peers have just left
EXPIRATION = 120.0  # seconds a record stays valid
REPUBLISH = 30.0  # seconds after which an unchanged record is published again
POLL = 2.0  # seconds between looks at the holder's step and parameters
MAX_RECORD_BYTES = 1 << 20  # per step in a record: ~29,000 tensors
MAX_STEP = 10**9


# --- the records ----------------------------------------------------------------------------------------


class StepFingerprint(BaseModel):
    """A holder's fingerprint of its state at one global step."""

    epoch: conint(ge=0, le=MAX_STEP, strict=True)
    layout: constr(regex=r"^[0-9a-f]{16}$", strict=True)  # layout_hash of the tensors' sizes
    numels: conlist(conint(ge=0, strict=True), max_items=MAX_RECORD_BYTES // 36)
    values: bytes  # float32: the norms, then SAMPLES_PER_TENSOR values per tensor
    # DiLoCo: the lineage its holder vouches for at this step, and the fingerprint of its outer momentum (as
    # ``values``, of the leading tensors: the global parameters); absent elsewhere and in older records
    lineage: conbytes(min_length=LINEAGE_BYTES, max_length=LINEAGE_BYTES, strict=True) | None = None
    momentum: bytes | None = None

    @root_validator(skip_on_failure=True)
    def _consistent(cls, values: dict) -> dict:
        if layout_hash(values["numels"]) != values["layout"]:
            raise ValueError("the layout's hash does not match the tensors' sizes")
        row = 4 * (1 + SAMPLES_PER_TENSOR)
        if len(values["values"]) != row * len(values["numels"]):
            raise ValueError("the fingerprint's length does not match its tensors")
        momentum = values.get("momentum")
        if momentum is not None and (len(momentum) % row or len(momentum) > len(values["values"])):
            raise ValueError("the momentum's fingerprint does not match the tensors")
        return values

    def fingerprint(self) -> Fingerprint:
        return Fingerprint.from_bytes(self.epoch, self.numels, self.values)

    def attestation(self) -> Attestation | None:
        """The lineage this step's record attests and its momentum's fingerprint (None without a lineage)."""
        if self.lineage is None:
            return None
        momentum = None
        if self.momentum is not None:
            count = len(self.momentum) // (4 * (1 + SAMPLES_PER_TENSOR))
            momentum = Fingerprint.from_bytes(self.epoch, self.numels[:count], self.momentum)
        return Attestation(self.lineage, momentum)


class FingerprintRecord(BaseModel):
    """What one state holder publishes: its fingerprints for its last HISTORY steps."""

    states: conlist(StepFingerprint, min_items=1, max_items=HISTORY)
    peer_id: constr(regex=r"^[1-9A-HJ-NP-Za-km-z]{1,128}$", strict=True)  # its libp2p peer id (base58)
    time: confloat(ge=0.0, le=1e11, strict=True) = 0.0


class FingerprintSchema(BaseModel):
    fingerprints: dict[BytesWithPublicKey, FingerprintRecord]


def fingerprint_validators(run_id: str) -> list[SchemaValidator]:
    """The SchemaValidator of ``{run_id}_state_averager_fingerprints`` (merged into the run's validators)."""
    return [SchemaValidator(FingerprintSchema, prefix=state_averager_prefix(run_id))]


def step_record(
    fp: Fingerprint, lineage: bytes | None = None, momentum: Fingerprint | None = None
) -> StepFingerprint:
    """The record of ``fp``, with the lineage its holder vouches for at that step and its momentum's
    fingerprint (DiLoCo) where given."""
    return StepFingerprint(
        epoch=fp.epoch,
        layout=fp.layout,
        numels=list(fp.numels),
        values=fp.to_bytes(),
        lineage=lineage,
        momentum=momentum.to_bytes() if lineage is not None and momentum is not None else None,
    )


@dataclass(frozen=True)
class Published:
    """One holder's record as read: the peer id it names, its fingerprint per step, and per step the lineage
    it attests there (DiLoCo holders that vouch for one)."""

    peer_id: str
    steps: dict[int, Fingerprint]
    attested: dict[int, Attestation] = dataclasses.field(default_factory=dict)


def state_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of a served state is finite. An honest state is (its holder's NaN guard sees to it,
    and DiLoCo's global parameters are the guard's own backup): one that is not is never loaded."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def read_fingerprints(dht: Any, key: str) -> dict[bytes, Published]:
    """Every holder's published fingerprints under ``key``, by the key that signed them (one vote per key: the
    peer id a record names is its own claim, so two keys naming one peer are two votes, and a forger naming
    an honest peer takes nothing from it); malformed records are dropped."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out: dict[bytes, Published] = {}
    for subkey, entry in found.value.items():
        try:
            record = FingerprintRecord.parse_obj(entry.value)
            attested = {s.epoch: s.attestation() for s in record.states if s.lineage is not None}
            out[subkey] = Published(
                record.peer_id, {s.epoch: s.fingerprint() for s in record.states}, attested
            )
        except Exception as e:  # a record of another version, or garbage: never crash the reader
            logger.debug(f"ignoring a malformed state fingerprint record: {e}")
    return out


class FingerprintPublisher(threading.Thread):
    """Publishes a holder's fingerprints every POLL seconds when its step, its parameters or the lineage it
    attests changed (every REPUBLISH seconds otherwise, at once when ``nudge``d), keeping its last HISTORY
    steps."""

    def __init__(self, holder: Any) -> None:
        super().__init__(daemon=True, name="state-fingerprints")
        self.holder = holder
        self.key = fingerprints_key(holder.prefix)
        self.history: dict[int, StepFingerprint] = {}
        self.published = (-1, torch.zeros(0), 0.0, None)  # step, sampled values, time, lineage attested
        self.closed = threading.Event()
        self.nudged = threading.Event()

    def run(self) -> None:
        while not self.closed.is_set():
            self.nudged.wait(POLL)
            self.nudged.clear()
            if self.closed.is_set():
                break
            try:
                self.publish()
            except Exception as e:  # network trouble degrades: the next round tries again
                logger.debug(f"publishing the state's fingerprint failed: {e!r}")

    def nudge(self) -> None:
        """Look at the holder now (it just vouched for a lineage), not at the next POLL."""
        self.nudged.set()

    def publish(self, force: bool = False) -> None:
        """Publish the holder's fingerprint if its step, its sampled values or the lineage it attests changed
        since the last one (the norms, a pass over every parameter, are computed only then), or REPUBLISH
        seconds went by."""

        holder = self.holder
        last_epoch, last_samples, last_time, last_lineage = self.published
        with holder.lock_averaged_tensors:
            epoch = int(holder.local_epoch)
            tensors = holder.fingerprinted_tensors()
            samples = sampled_values(tensors, epoch)
            attested = holder.attestation(epoch, tensors)
            lineage = attested[0] if attested is not None else None
            changed = epoch != last_epoch or not torch.equal(samples, last_samples) or lineage != last_lineage
            if not (force or changed or time.monotonic() - last_time >= REPUBLISH):
                return
            fp = fingerprint(tensors, epoch, samples)
            momentum = None
            if attested is not None and attested[1] is not None:
                momentum = fingerprint(attested[1], epoch)
        self.history[epoch] = step_record(fp, lineage, momentum)
        for old in sorted(self.history)[:-HISTORY]:
            del self.history[old]
        record = FingerprintRecord(
            states=[self.history[e] for e in sorted(self.history)],
            peer_id=str(holder.dht.peer_id),
            time=time.time(),
        )
        holder.dht.store(
            self.key,
            record.dict(),
            get_dht_time() + EXPIRATION,
            subkey=holder.public_key,
            return_future=True,
        )
        self.published = (epoch, samples, time.monotonic(), lineage)

    def close(self) -> None:
        self.closed.set()
        self.nudged.set()
        join_at_exit(self)  # it may be computing a fingerprint, a pass over every parameter


# --- the holders ----------------------------------------------------------------------------------------


class CheckedStateDownloads(Averager):
    """A mixin for hivemind's ``TrainingStateAverager`` (and cotrain's ``DiLoCoStateAverager``): publishes
    the fingerprint of the state it holds, and downloads a state only from a donor whose state matches the
    fingerprints others published (see the module's doc). The first tensors of the served state, the
    optimizer's parameters and the extra tensors, are the ones fingerprinted."""

    def __init__(
        self,
        *args: Any,
        progress_key: str | None = None,
        witnessed_key: str | None = None,
        keeps_state: bool = False,
        **kwargs: Any,
    ) -> None:
        """``progress_key``: the run's progress records (cotrain.keys.progress_key), given where the
        swarm's progress is counted robustly: donors beyond the epoch that two other full peers reached are
        then not asked while one within it serves (``within_witnessed``). ``witnessed_key``: the same records,
        read at every download to bound the step of a served state (``served_refusal``: DiLoCo's round and
        inner step) by the one the swarm witnesses, whatever the aggregation. ``keeps_state``: the copy of a
        monitor (or evaluation peer), which never averages: it answers state downloads only. An auxiliary
        reducer's (``auxiliary=True``) answers all-reduces only, and publishes no fingerprint: the state it
        holds is not the swarm's (it reduces for others and never steps)."""

        if keeps_state:
            self.serve_only(frozenset({"rpc_download_state"}))
        elif kwargs.get("auxiliary"):
            self.serve_only(frozenset({"rpc_join_group", "rpc_aggregate_part", "rpc_direct_offer"}))

        self.progress_key, self.witnessed_key = progress_key, witnessed_key
        self.poisoned = PoisonedState.from_env()  # fault injection: serve a corrupted copy
        self.public_key = RSASignatureValidator().local_public_key  # the process-wide key that signs records
        self.suspects: dict[str, float] = {}  # donor -> until when it is asked last (averager's process)
        self.unreachable: dict[str, float] = {}  # the same, for donors that could not be reached
        self._held = mp.Value(ctypes.c_double, -1.0)  # the step held at the last download, for the averager
        super().__init__(*args, **kwargs)
        self.fingerprints = None if kwargs.get("auxiliary") else FingerprintPublisher(self)
        if self.fingerprints is not None:
            self.fingerprints.start()

    state_optimizers = (
        1  # optimizers whose statistics ride along in the served state (DiLoCo: the inner one too)
    )

    def state_bound(self) -> tuple[int, int]:
        """The most tensors and bytes a donor's state may hold (cotrain.algorithms.statelimit): from this
        holder's parameters, which every peer of the run shares, not from its optimizer's statistics, which a
        newcomer has not built yet. Shapes do not change, so no lock is taken."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return state_bound(params, list(self.extra_tensors), self.state_optimizers)

    def fingerprinted_tensors(self) -> list[torch.Tensor]:
        """The tensors the fingerprint covers, in the order they are served (call under the tensors' lock)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]] + list(self.extra_tensors)

    def attestation(self, epoch: int, tensors: list[torch.Tensor]) -> tuple[bytes, list | None] | None:
        """What this holder's record attests at ``epoch`` for its ``tensors`` (``fingerprinted_tensors``;
        called under their lock) beyond their fingerprint: a DiLoCo holder's lineage and outer momentum
        (cotrain.hivemind_ext.diloco_state). None here."""
        return None

    def served_refusal(self, metadata: Mapping[str, Any], witnessed: int | None) -> str | None:
        """Why a donor's state is refused before its fingerprint is judged (what it is, for the log line), or
        None: DiLoCo refuses a round far beyond ``witnessed`` (the step the swarm's progress records witness,
        None when none is read) and an inner step outside its round (cotrain.hivemind_ext.diloco_state)."""
        return None

    def settle_download(self, donor: str, loaded: tuple, records: Mapping[Any, Published]) -> None:
        """Adjust a donor's state that is about to be loaded, given the others' ``records``: a DiLoCo holder
        drops a lineage that no other record attests for that state (cotrain.hivemind_ext.diloco_state)."""

    # --- serving ---

    def get_current_state(self):
        metadata, tensors, infos = super().get_current_state()
        if self.poisoned.active:
            tensors = self.poisoned.serve(tensors, self._fingerprinted_count())
        return metadata, tensors, infos

    @property
    def state_sharing_priority(self) -> float:
        """hivemind's priority (the holder's step), which the poisoned-state attack raises."""
        return self.poisoned.priority(DecentralizedAverager.state_sharing_priority.fget(self))

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        DecentralizedAverager.state_sharing_priority.fset(self, value)

    def shutdown(self) -> None:
        publisher = getattr(self, "fingerprints", None)
        if publisher is not None:
            publisher.close()
        super().shutdown()

    # --- downloading ---

    def load_state_from_peers(self, **kwargs: Any):
        self.note_held_step()
        return super().load_state_from_peers(**kwargs)

    def note_held_step(self) -> None:
        """Tell the averager's process the step this peer holds before a download: donors not ahead of it
        come last (``donor_order``)."""
        self._held.value = float(self.local_epoch)

    # (in the averager's process)

    async def download_state(self, future: Any, timeout: float | None = None) -> None:
        """hivemind's download of the state from peers (an adapted copy: its entry in
        cotrain.hivemind_ext.manifest), with each donor's state checked against the published fingerprints
        before it is handed to ``load_state_from_peers``."""

        # done a little before the caller stops waiting, so that a state found late is still taken
        deadline = None if timeout is None else time.monotonic() + timeout - min(2.0, timeout / 10)
        chunk_timeout = None
        if timeout is not None:
            chunk_timeout = self.next_chunk_timeout or self.request_timeout
        try:
            served = self.dht.get(f"{self.group_key_prefix}.all_averagers", latest=True)
            priorities = {
                PeerID(peer): float(info.value)
                for peer, info in (served.value.items() if served is not None else ())
                if isinstance(info, ValueWithExpiration) and isinstance(info.value, int | float)
            }
            priorities.pop(self.peer_id, None)
            if not priorities:
                logger.info("No peer serves the swarm's state yet")
                return
            mine = str(self.peer_id)
            published = read_fingerprints(self.dht, fingerprints_key(self.prefix))
            own = [p for key, p in published.items() if key == self.public_key]
            anchors = [p for key, p in published.items() if key in getattr(self.dht, "anchor_signers", ())]
            records = one_vote_each(  # a private swarm: one vote per participant (cotrain.access.voters)
                {key: p for key, p in published.items() if key != self.public_key and p.peer_id != mine},
                voters_of(self.dht),
            )
            now = time.monotonic()
            self.suspects = {peer: until for peer, until in self.suspects.items() if until > now}
            self.unreachable = {peer: until for peer, until in self.unreachable.items() if until > now}
            offered = {p.to_base58(): v for p, v in priorities.items()}
            if self.progress_key is not None:
                offered, beyond = within_witnessed(offered, self._witnessed_epoch())
                if beyond:
                    logger.info(
                        f"Not asking {', '.join(sorted(beyond))} for the state: their steps are beyond "
                        "the one that two other peers reached"
                    )
            order = donor_order(offered, records, {**self.unreachable, **self.suspects}, self._held.value)
            rounds = self._progress_epochs(self.witnessed_key) if self.witnessed_key is not None else []
            witnessed = self._witnessed_for(rounds)
            fallback, refuted = None, 0
            for position, (donor, worth) in enumerate(order):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if fallback is not None and not worth:
                    break
                remaining = None if deadline is None else max(0.1, deadline - time.monotonic())
                loaded = await self._download_bounded(PeerID.from_base58(donor), chunk_timeout, remaining)
                if loaded is None:
                    continue
                if not state_finite(loaded[1]):  # refused even where nobody vouches (the fallback below)
                    logger.warning(f"Peer {donor} served a state that is not finite; not loading it")
                    refuted += 1
                    self.suspects[donor] = time.monotonic() + SUSPECT_SECONDS
                    continue
                why = self.served_refusal(loaded[0], witnessed)
                if why is not None:
                    logger.warning(f"Peer {donor} served {why}: not loading it, trying another peer")
                    refuted += 1
                    self.suspects[donor] = time.monotonic() + SUSPECT_SECONDS
                    continue
                found = self._judge(donor, loaded, records, anchors, own)
                if found.accepted:
                    self.settle_download(donor, loaded, records)
                    future.set_result(loaded)
                    return
                if found.kind == "unverifiable":
                    fallback = fallback or (donor, loaded)
                    if not any(worth for _, worth in order[position + 1 :]):
                        break  # no donor is left whose step another peer vouched for
                else:
                    refuted += 1
                    self.suspects[donor] = time.monotonic() + SUSPECT_SECONDS
            if fallback is not None:
                donor, loaded = fallback
                logger.info(
                    f"No other peer published a fingerprint of the state at step {loaded[0]['epoch']}: "
                    f"loading peer {donor}'s state unchecked"
                )
                self.settle_download(donor, loaded, records)
                future.set_result(loaded)
            elif refuted:
                logger.warning(
                    f"None of the {len(order)} peers that serve the state served one that matches the "
                    "published fingerprints; not loading a state"
                )
        except Exception as e:
            logger.warning(f"Loading the state from peers failed: {e!r}")
        finally:
            if not future.done():
                future.set_result(None)

    def _witnessed_epoch(self) -> int | None:
        """``witnessed_epoch`` of the other full peers' progress records (None when none could be read)."""
        return witnessed_epoch(
            [epoch for epoch, client in self._progress_epochs(self.progress_key) if not client]
        )

    def _progress_epochs(self, key: str) -> list[tuple[int, bool]]:
        """(epoch, client mode) of the other peers' progress records under ``key``, one per participant in a
        private swarm; malformed and expired records count for nothing."""

        found = self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        mine, out = self.peer_id.to_bytes(), []
        for entry in one_vote_each(found.value, voters_of(self.dht)).values():
            try:
                progress = LocalTrainingProgress.parse_obj(entry.value)
            except Exception:
                continue
            if progress.peer_id != mine:
                out.append((progress.epoch, bool(progress.client_mode)))
        return out

    def _witnessed_for(self, rounds: list[tuple[int, bool]]) -> int | None:
        """The largest step that two of the other peers' progress records (``rounds``: ``_progress_epochs``,
        clients and donors included) reach, at least the step this peer holds; None where fewer than two
        report one (a single record, a donor's own perhaps, witnesses nothing)."""
        epochs = [epoch for epoch, _ in rounds]
        if len(epochs) < WITNESSES:
            return None
        return max(witnessed_epoch(epochs, WITNESSES), int(self._held.value))

    def _judge(
        self,
        donor: str,
        loaded: tuple,
        records: Mapping[Any, Published],
        anchors: list[Published] = (),
        own: list[Published] = (),
    ) -> Verdict:
        """Judge a donor's state by the records for its step (``verdict``), weighed by the initial peer's
        records (``anchors``, signed by the key its address named) and this peer's ``own``
        (``weigh_trusted``)."""
        metadata, tensors = loaded
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        count = self._fingerprinted_count()
        if (
            not isinstance(epoch, int)
            or isinstance(epoch, bool)
            or len(tensors) < max(count, served_tensor_count(metadata, count))
        ):
            # a stream cut short may end cleanly: loading it would fail on the missing optimizer statistics
            logger.warning(f"Peer {donor} served an incomplete state (no step, or tensors missing); skipped")
            return Verdict("refuted")
        mine = fingerprint(tensors[:count], epoch)
        at_epoch = {key: p.steps[epoch] for key, p in records.items() if epoch in p.steps}
        found = verdict(mine, at_epoch, {key for key, p in records.items() if p.peer_id == donor})
        found = weigh_trusted(
            found,
            mine,
            [p.steps[epoch] for p in anchors if epoch in p.steps],
            [p.steps[epoch] for p in own if epoch in p.steps],
            donor_is_anchor=any(p.peer_id == donor for p in anchors),
        )
        if found.kind == "refuted" and found.trusted:
            logger.warning(
                f"Peer {donor} served a state for step {epoch} that the initial peer's own fingerprint does "
                f"not match (distance {found.nearest:.3g} > {found.tolerance:.3g}, whatever {found.agree} of "
                f"{found.total} other records say): not loading it, trying another peer"
            )
        elif found.kind == "refuted":
            why = (
                f"distance {found.nearest:.3g} > {found.tolerance:.3g}"
                if found.nearest > found.tolerance
                else f"{found.rivals} agree on another state"
            )
            logger.warning(
                f"Peer {donor} served a state for step {epoch} that does not match the fingerprints other "
                f"peers published for that step ({found.agree} of {found.total} agree, {why}): not loading "
                "it, trying another peer"
            )
        elif found.kind == "verified" and found.trusted and not math.isfinite(found.nearest):
            logger.info(f"The state from peer {donor} for step {epoch} is the initial peer's own: loading it")
        elif found.kind == "verified" and found.trusted:
            logger.info(
                f"The state from peer {donor} for step {epoch} is vouched for by the {found.trusted} "
                f"(distance {found.nearest:.2g})"
            )
        elif found.kind == "verified":
            logger.info(
                f"The state from peer {donor} for step {epoch} matches {found.agree} of {found.total} "
                f"published fingerprints (distance {found.nearest:.2g})"
            )
        return found

    def _fingerprinted_count(self) -> int:
        return sum(len(g["params"]) for g in self.optimizer.param_groups) + len(self.extra_tensors)

    async def _download_bounded(self, peer: Any, chunk_timeout: float | None, timeout: float | None):
        """One donor's (metadata, tensors), or None when it sent none (hivemind's download loop, for one
        peer)."""
        try:
            return await asyncio.wait_for(self._download_from(peer, chunk_timeout), timeout)
        except StateTooLarge as e:
            logger.warning(
                f"Peer {peer} served a state larger than this model's can be ({e}); trying another peer"
            )
            return None
        except DonorUnreachable as e:
            self.unreachable[peer.to_base58()] = time.monotonic() + UNREACHABLE_SECONDS
            logger.info(f"Could not reach peer {peer} for the state ({e}); asking it last for a while")
            return None
        except Exception as e:
            logger.info(f"Failed to download the state from peer {peer}: {e!r}")
            return None

    async def _download_from(self, peer: Any, chunk_timeout: float | None):

        started = time.monotonic()
        logger.info(f"Downloading the state from peer {peer}")
        stub = self.get_stub(self.p2p, peer, namespace=self.prefix)
        budget = StateBudget(*self.state_bound())
        metadata, parts, tensors = None, [], []
        stream, first = await opened(stub.rpc_download_state(averaging_pb2.DownloadRequest()))
        async for message in aiter_with_timeout(chained(first, stream), timeout=chunk_timeout):
            budget.take(message)  # before its tensor is built: raises beyond what a state of this model holds
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a new tensor starts: the previous one is complete
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not metadata:
            logger.debug(f"Peer {peer} did not send its state")
            return None
        logger.info(f"Downloaded the state from peer {peer} in {time.monotonic() - started:.3f} s")
        return metadata, tensors


class CheckedTrainingStateAverager(
    ServedInThread, DirectTransport, CheckedStateDownloads, TrainingStateAverager, WatchedRounds
):
    """hivemind's ``TrainingStateAverager`` (the sync strategy's state, and the monitor's copy of it) with
    checked downloads and published fingerprints; its all-reduces of the parameters send their parts over
    direct connections where they can (cotrain.hivemind_ext.direct)."""

    # the protocol names of hivemind's TrainingStateAverager, so that peers, their access guard and their
    # stubs see the same averager as before
    handler_class = TrainingStateAverager


def served_tensor_count(metadata: Mapping[str, Any], fingerprinted: int) -> int:
    """How many tensors a served state's ``metadata`` names: the ``fingerprinted`` parameters and extras (or
    DiLoCo's ``outer_tensors``) and one per tensor of the optimizer statistics' flat description (hivemind's
    ``dump_optimizer_state``; DiLoCo's inner optimizer's too)."""

    def placeholders(flat: Any) -> int:
        if not isinstance(flat, list | tuple):
            return 0
        return sum(1 for e in flat if isinstance(e, dict) and e.get("type") == "tensor")

    outer = metadata.get("outer_tensors")
    if isinstance(outer, int) and not isinstance(outer, bool):  # DiLoCo: outer state, then the inner one's
        return outer + placeholders(metadata.get("inner_metadata"))
    return fingerprinted + placeholders(metadata.get("optimizer_metadata"))
