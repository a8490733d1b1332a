"""The DHT process's request pipe.

Here, with hivemind in the test process; the rest in tests/live/test_dht.py and
tests/unit/hivemind_ext/test_dht.py."""

import multiprocessing as mp
import os
from multiprocessing.connection import reduce_connection

import pytest
from hivemind.utils.mpfuture import MPFuture

from cotrain.hivemind_ext import requestpipe
from cotrain.hivemind_ext.dht import _TolerantRequests
from cotrain.hivemind_ext.requestpipe import RequestReceiver, RequestSender


def test_averager_shutdown_during_a_round_finalizes_runners_and_cancels_pending_groups():
    import asyncio
    from types import SimpleNamespace

    from hivemind.averaging.averager import DecentralizedAverager

    from cotrain.hivemind_ext import fixes

    fixes.apply()
    assert DecentralizedAverager._shutdown is fixes._shutdown
    finalized = []

    async def scenario():
        loop = asyncio.get_running_loop()
        pending, started = loop.create_future(), loop.create_future()
        started.set_result(SimpleNamespace(finalize=lambda cancel: finalized.append(cancel)))
        averager = SimpleNamespace(client_mode=True, _running_groups={b"a": pending, b"b": started})
        await fixes._shutdown(averager, timeout=1.0)
        return pending.cancelled()

    assert asyncio.run(scenario())
    assert finalized == [True]


def test_a_request_whose_sender_exited_is_dropped_and_the_next_one_served():
    inner, outer = CTX.Pipe(duplex=False)
    sender = CTX.Process(target=_send_with_reply_pipe_and_exit, args=(outer,))
    sender.start()
    sender.join(10)
    outer.send(("_get", [], {"key": "k"}))
    requests = _TolerantRequests(inner)
    assert requests.poll(5.0)
    assert requests.recv() == ("_get", [], {"key": "k"})
    assert not requests.poll(0.1)


def test_a_reply_pipe_crosses_once_per_process_and_every_request_is_answered(monkeypatch):
    reductions = []
    monkeypatch.setattr(
        requestpipe, "reduce_connection", lambda conn: reductions.append(conn) or reduce_connection(conn)
    )
    inner, outer = CTX.Pipe(duplex=False)
    server = CTX.Process(target=_answer_requests, args=(inner, 25))
    server.start()
    sender = RequestSender(outer)
    answers = _ask(sender, range(20))
    assert [a[1] for a in answers] == [i * 2 for i in range(20)]
    assert {a[0] for a in answers} == {server.pid}
    assert len(reductions) == 1, "the reply pipe was sent again after the first request"
    child = CTX.Process(target=_ask_from_a_child, args=(sender,))  # a forked averager sends its own pipe
    child.start()
    child.join(30)
    server.join(30)
    assert child.exitcode == 0 and server.exitcode == 0


def test_the_receiver_closes_the_reply_pipes_of_exited_processes():
    exited = CTX.Process(target=os._exit, args=(0,))
    exited.start()
    exited.join(10)
    stale_read, stale = CTX.Pipe(duplex=False)
    receiver = RequestReceiver()
    receiver.pipes[(exited.pid, "n", 1)] = stale
    inner, outer = CTX.Pipe(duplex=False)
    RequestSender(outer).send(("_get", [], {"future": MPFuture()}))
    request = receiver.loads(inner.recv_bytes())
    assert stale.closed and len(receiver.pipes) == 1
    ((token, pipe),) = receiver.pipes.items()
    assert token[0] == os.getpid() and request[2]["future"]._sender_pipe is pipe
    with pytest.raises(EOFError, match="never received"):
        receiver.loads(_named_only(outer_pid=12345))


def test_a_swarm_dht_answers_many_requests_from_its_peer_and_a_forked_process():
    from cotrain.net.dht import create_dht

    dht = create_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        from hivemind.utils import get_dht_time

        for i in range(30):
            assert dht.store(f"k{i % 3}", i, get_dht_time() + 60)
            assert dht.get(f"k{i % 3}", latest=True).value == i
        child = CTX.Process(target=_get_from_a_child, args=(dht,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert dht.get("k0", latest=True).value == 27
    finally:
        dht.shutdown()


CTX = mp.get_context("fork")


def _send_with_reply_pipe_and_exit(outer) -> None:
    _, reply = CTX.Pipe()
    outer.send(("_get", [], {"future_pipe": reply}))  # the receiver must fetch this fd from us
    os._exit(0)


def _answer_requests(inner, count: int) -> None:
    """A DHT process's loop in small: answer ``count`` requests through the futures they carry."""
    requests = _TolerantRequests(inner)
    for _ in range(count):
        assert requests.poll(30.0)
        _, _, kwargs = requests.recv()
        kwargs["future"].set_result((os.getpid(), kwargs["i"] * 2))
    os._exit(0)


def _ask(sender: RequestSender, numbers: range) -> list:
    futures = [MPFuture() for _ in numbers]
    for i, future in zip(numbers, futures, strict=True):
        sender.send(("_get", [], {"i": i, "future": future}))
    return [future.result(timeout=30) for future in futures]


def _ask_from_a_child(sender: RequestSender) -> None:
    answers = _ask(sender, range(100, 105))
    os._exit(0 if [a[1] for a in answers] == [i * 2 for i in range(100, 105)] else 1)


def _named_only(outer_pid: int) -> bytes:
    """A request naming a reply pipe by token that its receiver never got in full."""
    import io
    import pickle

    class Naming(pickle.Pickler):
        def persistent_id(self, obj):
            return (requestpipe._PIPE, (outer_pid, "x", 1), None) if obj == "pipe" else None

    buf = io.BytesIO()
    Naming(buf).dump(("_get", [], {"pipe": "pipe"}))
    return buf.getvalue()


def _get_from_a_child(dht) -> None:
    ok = all(dht.get(f"k{i}", latest=True).value == 27 + i for i in range(3) for _ in range(5))
    os._exit(0 if ok else 1)
