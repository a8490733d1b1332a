"""A peer's identity: the private key file behind ``--identity-path``, which fixes its peer id on restarts.

The file holds a libp2p private key in the format hivemind's ``p2pd`` reads (a ``crypto_pb2.PrivateKey``
protobuf around a DER RSA key). A missing file is created here, readable by its owner only (0600), written to
a temporary file and renamed so that no half-written key is ever left; an unreadable or corrupt file is one
clear error instead of a daemon that fails to start, and one readable by other users is used with a warning
naming the ``chmod`` that fixes it (cotrain.privatefile).

Two running peers must not share an identity: before starting, a peer that joins a swarm asks it whether its
peer id is already online (hivemind does the same, but from a helper node that maps router ports and
listens; this one does neither).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path

from cotrain.errors import UserError
from cotrain.hivemind_ext.hooks import p2p_client
from cotrain.hivemind_ext.unexported import ControlFailure
from cotrain.privatefile import warn_if_exposed

logger = logging.getLogger(__name__)

TAKEN_CHECK_SECONDS = 15.0  # bound on asking the swarm whether this identity is already online
TAKEN_CHECK_ATTEMPTS = 3  # lookups that may come back "not found" before the identity counts as free


def peer_id_of(data: bytes):
    """The libp2p peer id of a private key file's content (raises ValueError when it is not a key)."""
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_identity(data)
    except Exception as e:
        raise ValueError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None


def _new_key() -> bytes:
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    key = RSAPrivateKey()
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def ensure_identity(path: str | Path):
    """Load the identity at ``path`` or create it (mode 0600) when missing; return its peer id."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"--identity-path {path} is a folder; give a file name (it is created when missing)")
    if path.exists():
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"cannot read identity file {path}: {e.strerror}") from None
        try:
            peer_id = peer_id_of(data)
        except ValueError as e:
            raise UserError(
                f"identity file {path} is not a private key ({e}); remove it to create a new identity "
                f"(this peer's id will change)"
            ) from None
        warn_if_exposed(path, "identity file")  # a key in use that others may have read
        return peer_id
    data = _new_key()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    except OSError as e:
        raise UserError(f"cannot create identity file {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write identity file {path}: {e.strerror}") from None
    peer_id = peer_id_of(data)
    logger.info(f"Created a new identity {peer_id} in {path}")
    return peer_id


async def _is_online(peer_id, initial_peers: list[str], startup_timeout: float = 15.0) -> bool:
    from hivemind.p2p import P2P

    probe = await P2P.create(
        initial_peers=initial_peers,
        dht_mode="client",
        no_listen=True,
        nat_port_map=False,
        auto_nat=False,
        startup_timeout=startup_timeout,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TAKEN_CHECK_SECONDS
    try:
        # a probe that asks before it is connected to an initial peer finds nobody: on a loaded machine the
        # connection comes late, so wait for it, and ask again when the answer comes back fast and empty
        while not await probe.list_peers() and loop.time() < deadline:
            await asyncio.sleep(0.2)
        for attempt in range(TAKEN_CHECK_ATTEMPTS):
            try:
                dial = p2p_client(probe).connect(peer_id, [])
                await asyncio.wait_for(dial, max(0.1, deadline - loop.time()))
                return True
            except TimeoutError:
                return False
            except ControlFailure:
                if attempt + 1 == TAKEN_CHECK_ATTEMPTS or loop.time() + 0.5 >= deadline:
                    return False
                await asyncio.sleep(0.5)
        return False
    finally:
        await probe.shutdown()


def check_identity_free(
    path: str | Path, peer_id, initial_peers: list[str], startup_timeout: float = 15.0
) -> None:
    """Refuse to start when another running peer of the swarm already uses this identity."""
    if not initial_peers:
        return
    started = time.monotonic()
    try:
        online = asyncio.run(_is_online(peer_id, initial_peers, startup_timeout))
    except Exception as e:  # the real start reports an unreachable swarm with its own message
        logger.warning(f"Could not check whether identity {peer_id} is already online: {e!r}")
        return
    logger.debug(f"Checked whether identity {peer_id} is online in {time.monotonic() - started:.1f} s")
    if online:
        raise UserError(
            f"identity {path} (peer id {peer_id}) is already used by a running peer; "
            f"give each peer its own --identity-path file"
        )
