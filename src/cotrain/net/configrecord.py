"""Swarm-wide config agreement: every peer publishes its signed run config, and a newcomer whose config
differs from the swarm's is refused before it joins averaging.

Each peer stores, under the DHT key ``{run_id}_config`` and its own RSA public key as subkey (signed like
the metrics records), its ``RunConfig`` as canonical JSON, the config's hash and its tokenizer's hash. The
schema refuses a record whose hash does not match its content. Records live ``CONFIG_EXPIRATION`` seconds
and are republished every ``REPUBLISH_EVERY`` seconds while the peer runs, so a peer that left stops
counting within a minute and a half.

Each peer also stores its run id under the shared key ``cotrain_runs``, so that a peer that finds nobody of
its own run can name the runs that this DHT does carry (a mistyped ``--run-id``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from typing import Any

from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils import get_dht_time
from pydantic.v1 import BaseModel, StrictBool, confloat, constr, root_validator

from cotrain.access.voters import one_vote_each, voters_of
from cotrain.errors import UserError
from cotrain.keys import RUNS_KEY, config_key

logger = logging.getLogger(__name__)

CONFIG_EXPIRATION = 90.0  # seconds a published config record stays valid
REPUBLISH_EVERY = 20.0  # seconds between republications while the peer runs
MAX_CONFIG_CHARS = 20_000
# the role of a loop of one's own (cotrain.SwarmPeer): its record holds the settings it agrees on alone
API_ROLE = "api"


class ConfigMismatch(UserError):
    """This peer's swarm-wide settings differ from the swarm's."""


def canonical(fields: dict) -> str:
    """A run config's fields (a dict) as canonical JSON: the same settings give the same text and hash."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ConfigRecord(BaseModel):
    """One peer's swarm-wide settings as published to the DHT."""

    config: constr(min_length=2, max_length=MAX_CONFIG_CHARS, strict=True)  # canonical JSON of the run config
    hash: constr(regex=r"^[0-9a-f]{16}$", strict=True)  # text_hash(config)
    tokenizer_hash: constr(regex=r"^[0-9a-f]{0,64}$", strict=True) = ""  # "" when the peer has none
    role: constr(regex=r"^[a-z]{0,16}$", strict=True) = ""  # trainer, monitor, ...; "leaving": done training
    time: confloat(ge=0.0, le=1e11, strict=True) = 0.0
    peer_id: constr(regex=r"^[1-9A-HJ-NP-Za-km-z]{0,128}$", strict=True) = ""  # its libp2p peer id (base58)
    keeps_state: StrictBool = (
        False  # a monitor that checkpoints the swarm's state (takes leavers' final state)
    )
    # sha256 of the dataset manifest this peer trains with (or, a monitor, was given); "" when it has none:
    # a trainer checks a manifest it downloads against its initial peer's (cotrain.data.stream)
    manifest_sha256: constr(regex=r"^([0-9a-f]{64})?$", strict=True) = ""

    @root_validator(skip_on_failure=True)
    def _hash_matches(cls, values: dict) -> dict:
        if text_hash(values["config"]) != values["hash"]:
            raise ValueError("the config's hash does not match its content")
        try:
            if not isinstance(json.loads(values["config"]), dict):
                raise ValueError("the config is not a JSON object")
        except json.JSONDecodeError:
            raise ValueError("the config is not JSON") from None
        return values

    def fields(self) -> dict:
        return json.loads(self.config)


class ConfigSchema(BaseModel):
    config: dict[BytesWithPublicKey, ConfigRecord]


class RunsSchema(BaseModel):
    cotrain_runs: dict[BytesWithPublicKey, constr(regex=r"^[^./]{1,128}$", strict=True)]


def schema_validators(run_id: str) -> list[SchemaValidator]:
    """SchemaValidators for ``{run_id}_config`` and ``cotrain_runs`` (merged into the run's validators)."""
    return [SchemaValidator(ConfigSchema, prefix=run_id), SchemaValidator(RunsSchema)]


def make_record(
    fields: dict,
    role: str,
    tokenizer_hash: str = "",
    peer_id: str = "",
    keeps_state: bool = False,
    manifest_sha256: str = "",
) -> ConfigRecord:
    """This peer's record of its run config ``fields`` (the swarm-wide settings, as a dict)."""
    text = canonical(fields)
    return ConfigRecord(
        config=text,
        hash=text_hash(text),
        tokenizer_hash=tokenizer_hash,
        role=role,
        time=time.time(),
        peer_id=peer_id,
        keeps_state=keeps_state,
        manifest_sha256=manifest_sha256,
    )


def read_configs(dht: Any, run_id: str) -> dict[bytes, ConfigRecord]:
    """Every peer's valid config record of a run (malformed ones dropped)."""
    found = dht.get(config_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for subkey, entry in found.value.items():
        try:
            out[subkey] = ConfigRecord.parse_obj(entry.value)
        except Exception as e:  # a record another version wrote, or garbage: never crash the reader
            logger.debug(f"ignoring malformed config record: {e}")
    return out


def read_runs(dht: Any) -> Counter:
    """Run ids that peers of this DHT published, with how many peers each."""
    found = dht.get(RUNS_KEY, latest=True)
    runs: Counter = Counter()
    if found is not None and isinstance(found.value, dict):
        for entry in found.value.values():
            if isinstance(entry.value, str):
                runs[entry.value] += 1
    return runs


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def differences(mine: dict, theirs: dict, prefix: str = "") -> list[str]:
    """``name mine != theirs`` for every field that differs (nested tables as ``model.hidden_size``)."""
    out = []
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name, "(unset)"), theirs.get(name, "(unset)")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(f"{prefix}{name} {_show(a)} != {_show(b)}")
    return out


def projected(fields: dict, names: tuple[str, ...] | None) -> dict:
    """A record's ``fields`` on the settings ``names`` (all of them: None)."""
    return fields if names is None else {name: fields.get(name, "(unset)") for name in names}


def swarm_record(
    records: dict[bytes, ConfigRecord],
    voters: dict[bytes, str] | None = None,
    names: tuple[str, ...] | None = None,
) -> tuple[ConfigRecord, int] | None:
    """The config most peers publish (ties: the one published first), and how many peers publish it; with
    ``voters`` (a private swarm), most participants, one vote each (cotrain.access.voters). With ``names``
    (an API peer's settings, cotrain.engine.settings.API_RUN), most peers that agree on those, from every
    record; without, from the records of whole run configs (an API peer's holds its own settings alone)."""

    records = one_vote_each(records, voters, newest=lambda r: r.time)
    if names is None:
        records = {k: r for k, r in records.items() if r.role != API_ROLE}
    if not records:
        return None

    def key(r: ConfigRecord) -> str:
        return r.hash if names is None else text_hash(canonical(projected(r.fields(), names)))

    counts = Counter(key(r) for r in records.values())
    first = {}
    for r in sorted(records.values(), key=lambda r: r.time):
        first.setdefault(key(r), r)
    best = max(counts, key=lambda h: (counts[h], -first[h].time))
    return first[best], counts[best]


def check_agreement(
    records: dict[bytes, ConfigRecord],
    mine: ConfigRecord,
    run_id: str,
    public_key: bytes,
    voters: dict[bytes, str] | None = None,
    names: tuple[str, ...] | None = None,
) -> None:
    """Raise ConfigMismatch naming every differing field when this peer's config is not the swarm's (with
    ``voters``, a private swarm's: one vote per participant; with ``names``, on those settings alone)."""

    others = one_vote_each({k: r for k, r in records.items() if k != public_key}, voters, lambda r: r.time)
    found = swarm_record(others, names=names)
    if found is None:
        return
    theirs, peers = found
    problems = differences(projected(mine.fields(), names), projected(theirs.fields(), names))
    tokenizers = Counter(r.tokenizer_hash for r in others.values() if r.tokenizer_hash)
    if mine.tokenizer_hash and tokenizers:
        common = tokenizers.most_common(1)[0][0]
        if common != mine.tokenizer_hash:
            problems.append(f"tokenizer {mine.tokenizer_hash[:12]} != {common[:12]}")
    if problems:
        raise ConfigMismatch(
            f"this peer's config differs from the swarm's (run {run_id!r}, {peers} peer"
            f"{'s' if peers != 1 else ''}; this peer's value != the swarm's): {', '.join(problems)}; "
            f"use the swarm's settings or another run id"
        )


def join_check(
    dht: Any,
    run_id: str,
    mine: ConfigRecord,
    public_key: bytes,
    initial_peers: list,
    names: tuple[str, ...] | None = None,
) -> None:
    """Refuse a config that differs from the swarm's (on ``names`` alone, when given); warn when nobody of
    this run is found (with the runs that this DHT carries) although initial peers were given."""

    records = read_configs(dht, run_id)
    check_agreement(records, mine, run_id, public_key, voters_of(dht), names)
    if initial_peers and not any(k != public_key for k in records):
        runs = read_runs(dht)
        runs.pop(run_id, None)
        if runs:
            known = ", ".join(f"{name!r} ({n} peer{'s' if n != 1 else ''})" for name, n in runs.most_common())
            logger.warning(
                f"No peer of run {run_id!r} was found through the initial peers, which carry the runs "
                f"{known}: check --run-id (this peer trains on its own until others of run {run_id!r} join)"
            )
        else:
            logger.info(f"No other peer of run {run_id!r} was found yet: this peer starts the run")


class ConfigPublisher(threading.Thread):
    """Publishes this peer's config record and run id now and every REPUBLISH_EVERY seconds until closed."""

    def __init__(self, dht: Any, run_id: str, public_key: bytes, record: ConfigRecord):
        super().__init__(daemon=True, name="config-publisher")
        self.dht, self.run_id, self.public_key, self.record = dht, run_id, public_key, record
        self._closed = threading.Event()

    def publish(self) -> None:

        expiration = get_dht_time() + CONFIG_EXPIRATION
        value = self.record.dict()
        self.dht.store(config_key(self.run_id), value, expiration, subkey=self.public_key, return_future=True)
        self.dht.store(RUNS_KEY, self.run_id, expiration, subkey=self.public_key, return_future=True)

    def run(self) -> None:
        while True:
            try:
                self.publish()
            except Exception as e:  # network trouble degrades: the next round tries again
                logger.debug(f"publishing the config record failed: {e!r}")
            if self._closed.wait(REPUBLISH_EVERY):
                return

    def announce(self, **changes: Any) -> None:
        """Publish this peer's record again now, with some fields changed (e.g. role="leaving")."""
        self.record = self.record.copy(update={**changes, "time": time.time()})
        try:
            self.publish()
        except Exception as e:
            logger.debug(f"publishing the config record failed: {e!r}")

    def close(self) -> None:
        self._closed.set()
