"""Signed, schema-validated metrics records that peers publish to the DHT under ``{run_id}_metrics``.

Each peer writes one subkey, its own RSA public key; hivemind's ``RSASignatureValidator`` refuses a
record whose
subkey names another peer's key, and ``SchemaValidator`` refuses values outside the schema (negative,
NaN, absurd).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictBool, confloat, conint, constr

from cotrain.access.voters import one_vote_each, voters_of, voters_validators
from cotrain.hivemind_ext.statecheck import fingerprint_validators
from cotrain.keys import eval_key, metrics_key
from cotrain.net.configrecord import schema_validators

logger = logging.getLogger(__name__)

MAX_SAMPLES_PER_SECOND = 1e6
MAX_STEP = 10**9  # a step beyond any schedule; steps far ahead of the swarm are the monitor's to ignore
MAX_LOSS = 1e7  # a diverged trainer's loss sum is reported as this bound


def reported_loss(total: float) -> float:
    """A trainer's loss sum as its record carries it: a diverged one (huge, infinite or NaN) as MAX_LOSS."""
    return min(max(total, 0.0), MAX_LOSS) if math.isfinite(total) else MAX_LOSS


class LocalMetrics(BaseModel):
    """What one trainer reports after each global step."""

    step: conint(ge=0, le=MAX_STEP, strict=True)
    samples_per_second: confloat(ge=0.0, le=MAX_SAMPLES_PER_SECOND, strict=True)
    samples_accumulated: conint(ge=0, le=10**9, strict=True)
    loss: confloat(ge=0.0, le=MAX_LOSS, strict=True)  # sum over mini_steps, as in the seed recipe
    mini_steps: conint(ge=0, le=10**7, strict=True)
    group_size: conint(
        ge=1, le=100_000, strict=True
    )  # peers in the last gradient-averaging group, self included
    client_mode: StrictBool = False
    time: confloat(ge=0.0, strict=True) = 0.0
    peer_id: constr(max_length=128, strict=True) = ""  # the trainer's libp2p peer id (base58)
    inner_steps: conint(ge=0, le=MAX_STEP, strict=True) = 0  # diloco: inner optimizer steps so far
    round_bytes: conint(ge=0, le=10**13, strict=True) = 0  # diloco: payload sent in the last outer all-reduce


class MetricsSchema(BaseModel):
    metrics: dict[BytesWithPublicKey, LocalMetrics]


MAX_PERPLEXITY = 1e30  # exp(69): a diverged model's perplexity is reported as this bound


class EvalMetrics(BaseModel):
    """What an evaluation peer reports after evaluating the swarm's state on held-out batches."""

    step: conint(ge=0, strict=True)  # the global step of the evaluated state
    loss: confloat(ge=0.0, le=1e4, strict=True)  # mean of the model's training loss over the batches
    perplexity: confloat(ge=1.0, le=MAX_PERPLEXITY, strict=True)  # exp of the token-level LM loss
    lm_loss: confloat(ge=0.0, le=1e4, strict=True)  # token-level masked/causal LM loss
    mlm_accuracy: confloat(ge=0.0, le=1.0, strict=True) | None = None  # masked tokens predicted exactly
    sop_accuracy: confloat(ge=0.0, le=1.0, strict=True) | None = None  # ALBERT's sentence-order task
    examples: conint(ge=1, le=10**7, strict=True)
    tokens: conint(ge=0, le=10**10, strict=True)  # predicted tokens behind lm_loss
    time: confloat(ge=0.0, strict=True) = 0.0
    peer_id: constr(max_length=128, strict=True) = ""


class EvalSchema(BaseModel):
    eval: dict[BytesWithPublicKey, EvalMetrics]


def make_validators(run_id: str) -> tuple[list[RecordValidatorBase], bytes]:
    """The record validators every peer of a run installs, and this process's public key (its subkey)."""

    signature_validator = RSASignatureValidator()
    validators = [
        SchemaValidator(MetricsSchema, prefix=run_id),
        SchemaValidator(EvalSchema, prefix=run_id),
        *schema_validators(run_id),  # the signed run config, see cotrain.net.configrecord
        *fingerprint_validators(
            run_id
        ),  # fingerprints of the served state, see cotrain.hivemind_ext.statecheck
        *voters_validators(run_id),  # a private swarm's voters, see cotrain.access.voters
        signature_validator,
    ]
    return validators, signature_validator.local_public_key


def read_records(dht: Any, key: str, schema: type[BaseModel], what: str) -> dict[bytes, Any]:
    """The latest entry under each subkey of ``key``, parsed with ``schema``. Entries that fail it (records of
    another version, garbage) are dropped with a debug line: a reader never crashes on them."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for subkey, entry in found.value.items():
        if entry is None or entry.value is None:
            continue
        try:
            out[subkey] = schema.parse_obj(entry.value)
        except Exception as e:
            logger.debug(f"ignoring malformed {what} record: {e}")
    return out


def store_record(dht: Any, key: str, public_key: bytes, record: BaseModel, expiration: float) -> None:
    """Store ``record`` under this peer's subkey (its public key: only it can write there), valid for
    ``expiration`` seconds; does not wait for the store to complete."""

    dht.store(
        key=key,
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + expiration,
        return_future=True,
    )


def read_metrics(dht: Any, run_id: str) -> dict[Any, LocalMetrics]:
    """The latest valid metrics record of every trainer (in a private swarm: of every participant, one each,
    cotrain.access.voters)."""

    records = read_records(dht, metrics_key(run_id), LocalMetrics, "metrics")
    return one_vote_each(records, voters_of(dht), newest=lambda r: r.time)


def publish_metrics(
    dht: Any, run_id: str, public_key: bytes, metrics: LocalMetrics, expiration: float
) -> None:
    store_record(dht, metrics_key(run_id), public_key, metrics, expiration)


def read_evaluations(dht: Any, run_id: str) -> dict[bytes, EvalMetrics]:
    """The latest valid evaluation record of every evaluation peer."""
    return read_records(dht, eval_key(run_id), EvalMetrics, "evaluation")


def publish_evaluation(
    dht: Any, run_id: str, public_key: bytes, metrics: EvalMetrics, expiration: float
) -> None:
    store_record(dht, eval_key(run_id), public_key, metrics, expiration)


def now() -> float:
    return time.time()
