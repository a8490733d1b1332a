"""The DHT record validators cotrain adds to hivemind's: a private swarm's revocation list
(``RevocationsValidator``)."""

from __future__ import annotations

from hivemind.dht import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from cotrain.access.authority import verify_revocations
from cotrain.access.crypto import PublicKey


class RevocationsValidator(RecordValidatorBase):
    """Refuses a revocation list in the DHT unless the authority signed it for the record's expiration: an
    allowlisted peer cannot hide revocations by storing another list under the same key."""

    def __init__(self, key: str, authority_public_key: bytes) -> None:
        self._key = DHTID.generate(source=key).to_bytes()
        self._authority_public_key = authority_public_key
        self._authority_key = PublicKey.from_bytes(authority_public_key)

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self._key:
            return True
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        return verify_revocations(value, self._authority_key, record.expiration_time)

    def __getstate__(self):
        return {"key": self._key, "authority_public_key": self._authority_public_key}

    def __setstate__(self, state):
        self._key = state["key"]
        self._authority_public_key = state["authority_public_key"]
        self._authority_key = PublicKey.from_bytes(state["authority_public_key"])
