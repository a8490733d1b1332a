"""The pipe that carries requests to a peer's DHT process, without a handshake per request.

Every request a process makes of hivemind's DHT (a get, a store, a coroutine to run) carries an ``MPFuture``
for its answer, and every ``MPFuture`` carries its process's reply pipe. multiprocessing pickles a pipe by
handing its file descriptor over a socket of the sending process's resource sharer: one connection, an HMAC
challenge each way and a descriptor passed, per request. At several requests a second (progress records on
every micro-batch, their reads near each step, metrics, fingerprints) that was about a sixth of a DHT
process's CPU.

Here the reply pipe crosses once per sending process: ``RequestSender`` (the sending end, in the peer and
in the averager processes forked from it) sends a process's reply pipe in full the first time and a token
naming it afterwards; ``RequestReceiver`` (in the DHT process) keeps the pipes it received by token, and
closes those whose process has exited.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import threading
from multiprocessing.connection import Connection, reduce_connection
from multiprocessing.reduction import ForkingPickler

from hivemind.utils.mpfuture import MPFuture

_PIPE = "cotrain.reply-pipe"  # the persistent id's tag


class _SenderState:
    """What one sending process knows: its token and whether its reply pipe has crossed already."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nonce = secrets.token_hex(8)
        self.sent: set[tuple[int, str, int]] = set()


class _RequestPickler(ForkingPickler):
    def __init__(self, file, state: _SenderState) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._state = state
        self.first: tuple | None = None

    def persistent_id(self, obj):
        if not isinstance(obj, Connection) or obj is not MPFuture._global_sender_pipe:
            return None
        token = (os.getpid(), self._state.nonce, id(obj))
        if token in self._state.sent:
            return (_PIPE, token, None)
        self.first = token
        return (_PIPE, token, reduce_connection(obj))


class RequestSender:
    """The sending end of the DHT's request pipe (hivemind's ``DHT._outer_pipe``), for every process that
    holds it; other attributes are the pipe's."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._states: dict[int, _SenderState] = {}

    def _state(self) -> _SenderState:
        # one state per process: a forked averager starts its own (a lock held by a thread of its parent at
        # the fork would stay held in the child forever)
        return self._states.setdefault(os.getpid(), _SenderState())

    def send(self, obj) -> None:
        state = self._state()
        with state.lock:  # the full pipe is written before any request that names it by token
            buf = io.BytesIO()
            pickler = _RequestPickler(buf, state)
            pickler.dump(obj)
            self._conn.send_bytes(buf.getbuffer())
            if pickler.first is not None:
                state.sent.add(pickler.first)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


class _RequestUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, pipes: dict[tuple, Connection]) -> None:
        super().__init__(io.BytesIO(data))
        self._pipes = pipes

    def persistent_load(self, pid):
        tag, token, reduced = pid
        if tag != _PIPE:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        if reduced is not None:
            rebuild, args = reduced
            conn = rebuild(*args)  # OSError/EOFError when the sender has exited: the caller drops the request
            _close_exited(self._pipes)
            old = self._pipes.pop(token, None)
            if old is not None:
                old.close()
            self._pipes[token] = conn
            return conn
        try:
            return self._pipes[token]
        except KeyError:
            raise EOFError(f"a request names the reply pipe of process {token[0]}, never received") from None


def _close_exited(pipes: dict[tuple, Connection]) -> None:
    """Close and forget the reply pipes of processes that have exited."""
    for token in list(pipes):
        try:
            os.kill(token[0], 0)
        except ProcessLookupError:
            pipes.pop(token).close()
        except PermissionError:  # alive, another user's: not ours to judge
            pass


class RequestReceiver:
    """Reads the requests ``RequestSender`` wrote, keeping every sending process's reply pipe."""

    def __init__(self) -> None:
        self.pipes: dict[tuple, Connection] = {}

    def loads(self, data: bytes):
        return _RequestUnpickler(data, self.pipes).load()
