"""The settings an address vouches for: every peer that publishes its config record
(cotrain.swarm.configrecord) also answers, over libp2p, with that record; a newcomer given only an address
asks the initial peers it names (``/p2p/ID``) first.

The address is the one thing the user vouched for, and libp2p authenticates the id of the peer that answers,
so the answer is that peer's settings, however many records other keys publish in the DHT (any process can
make new keys). The answer also names the key that signs the peer's DHT records, so that a newcomer knows
which of the records in the DHT are the address's own (the state check weighs its fingerprints above any
count of keys, cotrain.swarm.statecheck). A peer that does not answer (unreachable, or a version without this
handler) is skipped; an answer is size-capped, schema-checked (``ConfigRecord``) and must name the asked peer
and run.

In a private swarm a peer answers only a request that carries an access token the swarm accepts, so the run's
settings stay with its members, as its DHT records do.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Any

from cotrain.swarm.configrecord import MAX_CONFIG_CHARS, ConfigRecord

logger = logging.getLogger(__name__)

CONFIG_HANDLE = "cotrain.RunConfig"  # answered by every full peer that publishes its config record
MAX_ANSWER = 2 * MAX_CONFIG_CHARS + 4096  # bytes of an answer's record (its JSON escapes the config's text)
ASK_TIMEOUT = 5.0  # seconds an initial peer has to answer
MAX_SIGNER = 4096  # bytes of an answer's signing key (an RSA public key in OpenSSH form, wrapped)


@functools.cache
def messages():
    """The request and answer of the config handler, built at first use from a descriptor."""
    from cotrain.access.wire import build_messages

    # token: a private swarm's; record: JSON, empty when there is none
    return build_messages(
        "cotrain_config.proto",
        {
            "ConfigRequest": [("run_id", "string"), ("token", "bytes")],
            # signer: the key that signs the answering peer's DHT records (its state fingerprints count as
            # the address's own, cotrain.swarm.statecheck)
            "ConfigReply": [("record", "bytes"), ("signer", "bytes")],
        },
    )


def _access(node) -> Any:
    """A private swarm's AccessControl in the DHT process (None in a public swarm)."""
    return getattr(getattr(node.protocol, "authorizer", None), "access", None)


# --- the answering side ---------------------------------------------------------------------------------


async def _answer(served: dict[str, bytes], access: Any, request, context):
    m = messages()
    found = served.get(request.run_id)
    if found is None:
        return m.ConfigReply()
    record, signer = found
    if access is not None:
        from hivemind.proto.auth_pb2 import AccessToken

        try:
            token = AccessToken.FromString(request.token) if request.token else None
        except Exception:
            return m.ConfigReply()
        if access.refusal(token) is not None:
            return m.ConfigReply()
    return m.ConfigReply(record=record, signer=signer)


async def _serve(dht, node, run_id: str, record: bytes, signer: bytes) -> None:
    """Runs in the DHT's loop: answer config requests for ``run_id`` with ``record`` from now on (the handler
    is registered once; a later call replaces the record)."""
    served = getattr(dht, "served_configs", None)
    if served is None:
        served = dht.served_configs = {}
        if not node.protocol.client_mode:  # nobody can dial a client
            await node.p2p.add_protobuf_handler(
                CONFIG_HANDLE, functools.partial(_answer, served, _access(node)), messages().ConfigRequest
            )
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
    from hivemind.p2p import PeerID

    m = messages()
    access = _access(node)
    token = access.own().proto.SerializeToString() if access is not None else b""
    request = m.ConfigRequest(run_id=run_id, token=token)
    for peer in peers:
        try:
            reply = await asyncio.wait_for(
                node.p2p.call_protobuf_handler(
                    PeerID.from_base58(peer), CONFIG_HANDLE, request, m.ConfigReply
                ),
                timeout,
            )
        except Exception as e:  # unreachable, or a version without the handler: the next one
            logger.debug(f"initial peer {peer} did not answer the config request: {e!r}")
            continue
        record = parse_answer(reply.record, peer, run_id)
        if record is not None:
            signer = reply.signer if _is_signer(reply.signer) else b""
            return peer, record, signer
    return None


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
