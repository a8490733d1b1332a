"""A request's proof that its sender holds its access token's key, for the requests a private swarm answers
over libp2p outside the DHT (the run's settings, cotrain.net.vouch; the reachability probe,
cotrain.net.reachability).

A token alone proves nothing: voter records carry tokens, and so does every DHT request. So such a request
carries, beside its token, the time, a random nonce and a signature by the token's key over what the request
is for (``purpose``), the run, both peer ids (the asker's, which libp2p authenticates, and the answering
peer's own), the time and the nonce. The answering peer checks the token as for any request, the signature
with the key the token names, the time against its own clock (within ``MAX_CLOCK_SKEW``) and that it has not
seen the nonce before: a token read elsewhere, or a recorded request replayed or sent to another peer or for
another purpose, is refused. Imports hivemind only when a proof is made or checked.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import TimedStorage, get_dht_time

from cotrain.access.crypto import PublicKey

MAX_CLOCK_SKEW = 60.0  # seconds between a request's time and the answering peer's clock
NONCE_BYTES = 16  # a request's nonce (8 to 64 are accepted)


@dataclass(frozen=True)
class Proof:
    """What a request carries: the token (a serialized hivemind AccessToken), time, nonce, signature."""

    token: bytes
    time: float
    nonce: bytes
    signature: bytes


def payload(purpose: str, run_id: str, asker: bytes, asked: bytes, t: float, nonce: bytes) -> bytes:
    """What the token's key signs (see the module's doc); peer ids as bytes."""
    return b"\n".join([purpose.encode(), run_id.encode(), asker, asked, repr(float(t)).encode(), nonce])


def prove(access: Any, purpose: str, asker: bytes, asked: bytes) -> Proof:
    """This peer's proof (``access``: its cotrain.access.AccessControl) for one request from ``asker`` (this
    peer) to ``asked``."""

    own = access.own()
    t, nonce = get_dht_time(), secrets.token_bytes(NONCE_BYTES)
    signature = own.key.sign(payload(purpose, access.run_id, asker, asked, t, nonce))
    return Proof(own.proto.SerializeToString(), t, nonce, signature)


class SeenNonces:
    """The nonces of the requests answered in the last ``3 x MAX_CLOCK_SKEW`` seconds (older requests are
    refused by their time): a request is answered once."""

    def __init__(self) -> None:

        self._seen = TimedStorage()

    def __contains__(self, nonce: bytes) -> bool:
        return nonce in self._seen

    def add(self, nonce: bytes, now: float) -> None:
        self._seen.store(nonce, None, now + 3 * MAX_CLOCK_SKEW)


def refusal(
    access: Any, purpose: str, proof: Proof, asker: bytes | None, asked: bytes, seen: SeenNonces
) -> str | None:
    """Why a request from ``asker`` to ``asked`` (this peer) with ``proof`` is not answered, in one phrase, or
    None: its token is not one the swarm (``access``) accepts, or the request does not prove that the asker
    holds the token's key, freshly and for this peer (see the module's doc). Its nonce is then seen."""

    try:
        token = AccessToken.FromString(proof.token) if proof.token else None
    except Exception:
        return "a malformed access token"
    reason = access.refusal(token)
    if reason is not None:
        return reason
    now = get_dht_time()
    if not abs(proof.time - now) <= MAX_CLOCK_SKEW:  # NaN too
        return f"a request over {MAX_CLOCK_SKEW:.0f} s old or ahead (replayed, or a wrong clock)"
    if not 8 <= len(proof.nonce) <= 64 or proof.nonce in seen:
        return "a replayed request"
    if asker is None:
        return "a request from an unknown peer"
    signed_payload = payload(purpose, access.run_id, asker, asked, proof.time, proof.nonce)
    try:
        signed = PublicKey.from_bytes(token.public_key).verify(signed_payload, proof.signature)
    except Exception:
        signed = False
    if not signed:
        return "a request not signed by the key of the token it shows"
    seen.add(proof.nonce, now)
    return None
