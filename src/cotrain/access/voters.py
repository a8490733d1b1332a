"""One vote per participant in a private swarm: every record that counts as a vote is tied to a valid token,
and counted once per token.

DHT records are signed by an RSA key of the process that publishes them (hivemind's ``RSASignatureValidator``;
the key is in the record's subkey), and any process can make new keys: counted one per key, one insider could
outvote the honest peers in the state check, the run config a newcomer reads, the swarm's progress and the
monitor's metrics. So in a private swarm each process publishes, under ``{run_id}_voters`` and its signing
key as subkey, a voter record: its access token and, signed with the token's own private key, the statement
"this signing key votes for me in run RUN" (``proof_payload``). A reader (``Voters``) keeps only the signing
keys whose voter record holds a token the swarm accepts (the authority's signature, not revoked, not
expired) and a proof by that token's key of that very signing key (a record copied under another key proves
nothing), and names each by its token (``token_fingerprint``); ``one_vote_each`` then keeps one record per
token. A token holder may still sign for many keys, and run several machines with one token: they count as
one participant (give each machine its own token to count each).

In a public swarm there are no tokens: ``Voters.get`` is None, every key counts, and docs/security.md says
what votes there cannot prove.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.proto.auth_pb2 import AccessToken
from pydantic.v1 import BaseModel, conbytes

from cotrain.access.crypto import PublicKey
from cotrain.access.tokens import MAX_SIGNATURE, token_fingerprint
from cotrain.keys import voters_key

logger = logging.getLogger(__name__)

VOTER_FORMAT = b"cotrain-voter/1"
MAX_VOTER_TOKEN = 8192  # bytes of a serialized access token (a name, an RSA public key, a signature)
VOTER_EXPIRATION = 90.0  # seconds a voter record stays valid; republished every VOTER_REPUBLISH
VOTER_REPUBLISH = 20.0
VOTERS_REFRESH = 5.0  # seconds between a reader's reads of the voter records

T = TypeVar("T")


def proof_payload(run_id: str, signer: bytes) -> bytes:
    """What a token's key signs to let ``signer`` (a record subkey: an RSA public key) vote for it."""
    return b"\n".join([VOTER_FORMAT, run_id.encode(), signer])


class VoterRecord(BaseModel):
    token: conbytes(min_length=1, max_length=MAX_VOTER_TOKEN, strict=True)  # a serialized AccessToken
    proof: conbytes(min_length=1, max_length=MAX_SIGNATURE, strict=True)  # the token's key's signature


class VotersSchema(BaseModel):
    voters: dict[BytesWithPublicKey, VoterRecord]


def voters_validators(run_id: str) -> list[SchemaValidator]:
    """The DHT's schema for ``{run_id}_voters`` (types and sizes; the token and proof are checked on read)."""
    return [SchemaValidator(VotersSchema, prefix=run_id)]


def make_voter_record(access: Any, signer: bytes) -> VoterRecord:
    """This process's voter record: its token, and the token key's proof that ``signer`` votes for it."""
    own = access.own()
    return VoterRecord(
        token=own.proto.SerializeToString(), proof=own.key.sign(proof_payload(access.run_id, signer))
    )


def verify_voter(access: Any, signer: bytes, record: VoterRecord) -> str | None:
    """The participant (its token's fingerprint) that ``signer`` votes for, or None when ``record`` proves
    nothing: a token the swarm refuses, or a proof that is not by the token's key of this very signer."""
    try:
        token = AccessToken.FromString(record.token)
    except Exception:
        return None
    if access.refusal(token) is not None:
        return None
    try:
        key = PublicKey.from_bytes(token.public_key)
        if not key.verify(proof_payload(access.run_id, signer), record.proof):
            return None
    except Exception:
        return None
    return token_fingerprint(token.username, token.public_key, token.expiration_time)


def read_voters(dht: Any, access: Any) -> dict[bytes, str]:
    """Every signing key with a valid voter record in the DHT -> the participant it votes for."""
    found = dht.get(voters_key(access.run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for signer, entry in found.value.items():
        try:
            record = VoterRecord.parse_obj(entry.value)
        except Exception:
            continue
        who = verify_voter(access, signer, record)
        if who is not None:
            out[signer] = who
    return out


def one_vote_each(
    records: Mapping[bytes, T], voters: Mapping[bytes, str] | None, newest: Callable[[T], float] | None = None
) -> dict[Any, T]:
    """``records`` (signing key -> record) as votes: with ``voters`` (a private swarm), only the records of
    keys that vote for a participant, one per participant (the ``newest``, else the first), keyed by the
    participant; without (a public swarm), all of them."""
    if voters is None:
        return dict(records)
    out: dict[Any, T] = {}
    for signer, record in records.items():
        who = voters.get(signer)
        if who is None:
            continue
        if who not in out or (newest is not None and newest(record) > newest(out[who])):
            out[who] = record
    return out


class Voters:
    """This process's view of a private swarm's voters, read now and every ``VOTERS_REFRESH`` seconds in a
    thread (``get`` never waits for the DHT); one per DHT (``of``). Publishes this process's own voter record
    every ``VOTER_REPUBLISH`` seconds too."""

    def __init__(self, dht: Any, signer: bytes) -> None:
        self.dht, self.access, self.signer = dht, dht.access, signer
        self._voters: dict[bytes, str] = {}
        self._closed = threading.Event()
        self._published = 0.0
        self._tick()
        self._thread = threading.Thread(target=self._refresh_loop, daemon=True, name="voters")
        self._thread.start()

    @classmethod
    def of(cls, dht: Any) -> Voters | None:
        """The Voters of ``dht``'s private swarm, started at first use; None in a public swarm."""
        if getattr(dht, "access", None) is None:
            return None
        with _lock:
            voters = getattr(dht, "cotrain_voters", None)
            if voters is None:
                from hivemind.dht.crypto import RSASignatureValidator

                voters = dht.cotrain_voters = cls(dht, RSASignatureValidator().local_public_key)
            return voters

    def get(self) -> dict[bytes, str]:
        """Signing key -> participant, as last read (this process's own key included)."""
        return self._voters

    def _tick(self) -> None:
        if time.monotonic() - self._published >= VOTER_REPUBLISH:
            self.publish()
        try:
            voters = read_voters(self.dht, self.access)
        except Exception as e:  # network trouble: the previous view stands
            logger.debug(f"reading the voter records failed: {e!r}")
            return
        own = verify_voter(self.access, self.signer, make_voter_record(self.access, self.signer))
        if own is not None:  # this process votes for itself even before its record is readable
            voters[self.signer] = own
        self._voters = voters

    def publish(self) -> None:
        from hivemind.utils import get_dht_time

        self._published = time.monotonic()
        try:
            record = make_voter_record(self.access, self.signer)
            self.dht.store(
                voters_key(self.access.run_id),
                record.dict(),
                get_dht_time() + VOTER_EXPIRATION,
                subkey=self.signer,
                return_future=True,
            )
        except Exception as e:
            logger.debug(f"publishing this process's voter record failed: {e!r}")

    def _refresh_loop(self) -> None:
        while not self._closed.wait(VOTERS_REFRESH):
            self._tick()

    def close(self) -> None:
        self._closed.set()


_lock = threading.Lock()


def voters_of(dht: Any) -> dict[bytes, str] | None:
    """Signing key -> participant in ``dht``'s private swarm (None in a public one: every key counts)."""
    voters = Voters.of(dht)
    return None if voters is None else voters.get()
