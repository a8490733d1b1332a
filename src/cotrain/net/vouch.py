"""The settings an address vouches for: every peer that publishes its config record
(cotrain.net.configrecord) also answers, over libp2p, with that record; a newcomer given only an address
asks the initial peers it names (``/p2p/ID``) first.

The address is the one thing the user vouched for, and libp2p authenticates the id of the peer that answers,
so the answer is that peer's settings, however many records other keys publish in the DHT (any process can
make new keys). The answer also names the key that signs the peer's DHT records, so that a newcomer knows
which of the records in the DHT are the address's own (the state check weighs its fingerprints above any
count of keys, cotrain.hivemind_ext.statecheck). A peer that does not answer (unreachable, or a version
without this handler) is skipped; an answer is size-capped, schema-checked (``ConfigRecord``) and must name
the asked peer and run.

In a private swarm a peer answers only a request that carries an access token the swarm accepts and proves
that the asker holds the token's key: a signature by that key over the run, both peer ids (the asker's, which
libp2p authenticates, and the answering peer's own), the time and a random nonce (``request_payload``). The
answering peer checks the signature with the key the token names, the time against its own clock (within
``MAX_CLOCK_SKEW``) and that it has not seen the nonce before, so a token read elsewhere (voter records carry
tokens, and every DHT request does) or a recorded request, replayed or sent to another peer, is refused. The
run's settings stay with its members, as its DHT records do.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any

from hivemind.p2p import PeerID

from cotrain.access import possession
from cotrain.access.possession import MAX_CLOCK_SKEW, SeenNonces  # noqa: F401 (re-exported)
from cotrain.access.wire import build_messages
from cotrain.net.configrecord import MAX_CONFIG_CHARS, ConfigRecord

logger = logging.getLogger(__name__)

CONFIG_HANDLE = "cotrain.RunConfig"  # answered by every full peer that publishes its config record
MAX_ANSWER = 2 * MAX_CONFIG_CHARS + 4096  # bytes of an answer's record (its JSON escapes the config's text)
ASK_TIMEOUT = 5.0  # seconds an initial peer has to answer
MAX_SIGNER = 4096  # bytes of an answer's signing key (an RSA public key in OpenSSH form, wrapped)
PURPOSE = "cotrain-config-request/1"  # what a private swarm's request proves its token key for


@functools.cache
def messages():
    """The request and answer of the config handler, built at first use from a descriptor."""

    # token: a private swarm's, with its proof (time, nonce, signature: request_payload); record: JSON,
    # empty when there is none
    return build_messages(
        "cotrain_config.proto",
        {
            "ConfigRequest": [
                ("run_id", "string"),
                ("token", "bytes"),
                ("time", "double"),
                ("nonce", "bytes"),
                ("signature", "bytes"),
            ],
            # signer: the key that signs the answering peer's DHT records (its state fingerprints count as
            # the address's own, cotrain.hivemind_ext.statecheck)
            "ConfigReply": [("record", "bytes"), ("signer", "bytes")],
        },
    )


def _access(node) -> Any:
    """A private swarm's AccessControl in the DHT process (None in a public swarm)."""
    return getattr(getattr(node.protocol, "authorizer", None), "access", None)


def request_payload(run_id: str, asker: Any, asked: Any, t: float, nonce: bytes) -> bytes:
    """What the asker's token key signs in a private swarm's config request: the run, the asker's and the
    asked peer's ids (hivemind PeerIDs), the time and the nonce (cotrain.access.possession)."""
    return possession.payload(PURPOSE, run_id, asker.to_bytes(), asked.to_bytes(), t, nonce)


def proof_refusal(access: Any, request, context, seen: SeenNonces) -> str | None:
    """Why a private swarm's config ``request`` (from ``context.remote_id`` to ``context.local_id``) is not
    answered, or None: its token is not one the swarm accepts, or the request does not prove that the asker
    holds the token's key, freshly and for this peer (cotrain.access.possession)."""
    asker = getattr(context, "remote_id", None)
    asked = getattr(context, "local_id", None)
    proof = possession.Proof(request.token, request.time, request.nonce, request.signature)
    return possession.refusal(
        access,
        PURPOSE,
        proof,
        None if asker is None else asker.to_bytes(),
        b"" if asked is None else asked.to_bytes(),
        seen,
    )


# --- the answering side ---------------------------------------------------------------------------------


async def _answer(served: dict[str, bytes], access: Any, request, context, *, seen: SeenNonces):
    m = messages()
    found = served.get(request.run_id)
    if found is None:
        return m.ConfigReply()
    record, signer = found
    if access is not None:
        reason = proof_refusal(access, request, context, seen)
        if reason is not None:
            peer = getattr(context, "remote_id", None)
            logger.debug(f"Not answering peer {peer}'s config request: {reason}")
            return m.ConfigReply()
    return m.ConfigReply(record=record, signer=signer)


async def _serve(dht, node, run_id: str, record: bytes, signer: bytes) -> None:
    """Runs in the DHT's loop: answer config requests for ``run_id`` with ``record`` from now on (the handler
    is registered once; a later call replaces the record)."""
    served = getattr(dht, "served_configs", None)
    if served is None:
        served = dht.served_configs = {}
        if not node.protocol.client_mode:  # nobody can dial a client
            answer = functools.partial(_answer, served, _access(node), seen=SeenNonces())
            await node.p2p.add_protobuf_handler(CONFIG_HANDLE, answer, messages().ConfigRequest)
    served[run_id] = (record, signer)


def serve_config(dht, run_id: str, record: ConfigRecord, signer: bytes = b"") -> None:
    """Answer other peers' config requests for ``run_id`` with ``record`` and ``signer`` (the key that signs
    this peer's DHT records); called again: with a newer record."""
    dht.run_coroutine(functools.partial(_serve, run_id=run_id, record=record.json().encode(), signer=signer))


# --- the asking side ------------------------------------------------------------------------------------


def peer_ids(maddrs: list[str]) -> list[str]:
    """The peer ids that ``maddrs`` name (``/p2p/ID``), in order, each once."""
    out: list[str] = []
    for m in maddrs:
        if "/p2p/" in m:
            peer = m.split("/p2p/")[-1].split("/")[0]
            if peer and peer not in out:
                out.append(peer)
    return out


def parse_answer(raw: bytes, peer: str, run_id: str) -> ConfigRecord | None:
    """The record in ``peer``'s answer when it is one: within the size cap, valid, of ``peer`` itself and of
    run ``run_id``; None otherwise (an empty answer: the peer is not of this run or refused the request)."""
    if not raw or len(raw) > MAX_ANSWER:
        return None
    try:
        record = ConfigRecord.parse_obj(json.loads(raw))
    except Exception as e:
        logger.debug(f"initial peer {peer} answered a malformed config record: {e}")
        return None
    if record.peer_id != peer or record.fields().get("run_id") != run_id:
        logger.debug(f"initial peer {peer} answered a record of another peer or run")
        return None
    return record


async def _ask(
    dht, node, run_id: str, peers: list[str], timeout: float
) -> tuple[str, ConfigRecord, bytes] | None:
    """Runs in the DHT's loop: the first of ``peers`` (in order) that answers with its config record (and the
    key that signs its records, b"" from a peer that does not say)."""

    m = messages()
    access = _access(node)
    for peer in peers:
        try:
            peer_id = PeerID.from_base58(peer)
            request = signed_request(access, run_id, node.peer_id, peer_id)
            reply = await asyncio.wait_for(
                node.p2p.call_protobuf_handler(peer_id, CONFIG_HANDLE, request, m.ConfigReply), timeout
            )
        except Exception as e:  # unreachable, or a version without the handler: the next one
            logger.debug(f"initial peer {peer} did not answer the config request: {e!r}")
            continue
        record = parse_answer(reply.record, peer, run_id)
        if record is not None:
            signer = reply.signer if _is_signer(reply.signer) else b""
            return peer, record, signer
    return None


def signed_request(access: Any, run_id: str, asker: Any, asked: Any):
    """A config request for ``run_id`` from ``asker`` to ``asked`` (PeerIDs): in a private swarm (``access``)
    with this peer's token and its proof, signed by the token's key for this one request."""
    m = messages()
    if access is None:
        return m.ConfigRequest(run_id=run_id)
    proof = possession.prove(access, PURPOSE, asker.to_bytes(), asked.to_bytes())
    return m.ConfigRequest(
        run_id=run_id, token=proof.token, time=proof.time, nonce=proof.nonce, signature=proof.signature
    )


def _is_signer(signer: bytes) -> bool:
    """Whether ``signer`` has the shape of a DHT record subkey's public key (``[owner:ssh-rsa ...]``)."""
    return 0 < len(signer) <= MAX_SIGNER and signer.startswith(b"[owner:") and signer.endswith(b"]")


def ask_initial_peers(
    dht, run_id: str, initial_peers: list[str], timeout: float = ASK_TIMEOUT
) -> tuple[str, ConfigRecord, bytes] | None:
    """The run config that the first answering initial peer (in the order given) publishes, with its peer id
    and the key that signs its DHT records (b"" when it does not say); None when none of them answers."""
    peers = peer_ids(initial_peers)
    if not peers:
        return None
    try:
        return dht.run_coroutine(
            functools.partial(_ask, run_id=run_id, peers=peers, timeout=timeout), return_future=True
        ).result(timeout=timeout * len(peers) + 10)
    except Exception as e:  # the DHT is stopping: nobody answered
        logger.debug(f"asking the initial peers for the run config failed: {e!r}")
        return None
