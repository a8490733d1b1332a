"""hivemind's DHT as cotrain serves it: a serving side that survives requests from exited processes, a
record validator that remembers its verdicts, access control in a private swarm and (by default) serving
from a thread of the peer's process (cotrain.hivemind_ext.hosting). Started by cotrain.net.dht.create_dht."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import struct
from collections import OrderedDict

from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P

from cotrain.hivemind_ext.guard import GuardedP2P
from cotrain.hivemind_ext.hooks import DHT
from cotrain.hivemind_ext.hosting import ServedInThread
from cotrain.hivemind_ext.requestpipe import RequestReceiver, RequestSender

logger = logging.getLogger(__name__)


class _TolerantRequests:
    """The DHT process's end of its request pipe, dropping requests whose sender has exited.

    Each request carries a reply pipe (in full the first time a process sends one, see
    cotrain.hivemind_ext.requestpipe) that the receiving process fetches from the sender. When the sender
    (a trainer shutting down, an averager process ending) is gone before that happens, the plain pipe
    raises EOFError, which kills hivemind's DHT loop with a traceback. Nobody waits for such a request,
    so it is dropped instead."""

    def __init__(self, conn):
        self._conn, self._pending = conn, None
        self._receiver = RequestReceiver()

    def fileno(self) -> int:
        return self._conn.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        if self._pending is not None:
            return True
        while self._conn.poll(timeout):
            data = self._conn.recv_bytes()  # EOFError here means the pipe itself is closed: let it rise
            try:
                self._pending = self._receiver.loads(data)
                return True
            except (EOFError, OSError):  # its reply pipe could not be fetched from its sender
                logger.debug("Dropped a DHT request from a process that has exited")
                timeout = 0.0
        return False

    def recv(self):
        if self._pending is None and not self.poll(None):
            raise EOFError
        request, self._pending = self._pending, None
        return request

    def __getattr__(self, name):
        return getattr(self._conn, name)


class RememberedVerdicts(RecordValidatorBase):
    """The DHT process's record validator (hivemind's ``CompositeValidator``) remembering its verdict on each
    record it checked, by the record's digest.

    A read of a dictionary key (a swarm's progress records, state fingerprints, metrics) gets the whole
    dictionary from every node the search visits, and each node's copy is checked record by record: an RSA
    signature and a schema each, the same records again from every node and at every read. The validators are
    functions of the record alone (its key, subkey, value and expiration), so a verdict is remembered
    (``size`` records, the oldest forgotten first) until a validator is added."""

    def __init__(self, inner: CompositeValidator, size: int = 16384) -> None:
        self._inner, self._size = inner, size
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()

    @staticmethod
    def digest(record: DHTRecord) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        for part in (record.key, record.subkey, record.value):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        h.update(struct.pack("<d", record.expiration_time))
        return h.digest()

    def validate(self, record: DHTRecord) -> bool:
        digest = self.digest(record)
        verdict = self._verdicts.get(digest)
        if verdict is None:
            verdict = self._verdicts[digest] = self._inner.validate(record)
            if len(self._verdicts) > self._size:
                self._verdicts.popitem(last=False)
        return verdict

    def sign_value(self, record: DHTRecord) -> bytes:
        return self._inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self._inner.strip_value(record)

    def extend(self, validators) -> None:
        self._inner.extend(validators)
        self._verdicts.clear()


class SwarmDHT(ServedInThread, DHT):
    """hivemind's DHT whose serving process survives requests from peers' processes that have exited; with
    ``in_thread`` (cotrain's default) it serves from a thread of this process
    (cotrain.hivemind_ext.hosting).

    In a private swarm it carries the peer's access control (set before its process starts), and averager
    processes get a P2P that checks access tokens from ``replicate_p2p`` (see cotrain.access)."""

    def __init__(self, *args, access=None, in_thread: bool = True, **kwargs) -> None:
        self.access, self.in_thread = access, in_thread
        self._replicas: dict[tuple[int, asyncio.AbstractEventLoop], P2P] = {}
        super().__init__(*args, **kwargs)
        self.wrap_request_pipe(RequestSender)

    def run(self) -> None:
        self.wrap_served_requests(_TolerantRequests)
        self.wrap_record_validator(RememberedVerdicts)
        super().run()

    async def replicate_p2p(self):
        """A replica of the DHT's P2P for the calling event loop: hivemind keeps one per process, but each
        averager served from a thread (cotrain.hivemind_ext.hosting) runs its own loop, which a replica's
        streams belong to. In a private swarm the replica checks access tokens (cotrain.access)."""
        key = (os.getpid(), asyncio.get_running_loop())
        if key not in self._replicas:
            daemon_listen_maddr = self.daemon_listen_maddr()
            if self.access is None:
                replica = await P2P.replicate(daemon_listen_maddr)
            else:
                replica = await GuardedP2P.replicate_guarded(daemon_listen_maddr, self.access, self)
            self._replicas = {k: v for k, v in self._replicas.items() if k[0] == os.getpid()}
            self._replicas[key] = replica
        return self._replicas[key]
