"""The DHT process's request pipe: requests from processes that have exited are dropped, not fatal."""

import multiprocessing as mp
import os

import pytest

from cotrain.swarm.dht import _TolerantRequests

CTX = mp.get_context("fork")


def _send_with_reply_pipe_and_exit(outer) -> None:
    _, reply = CTX.Pipe()
    outer.send(("_get", [], {"future_pipe": reply}))  # the receiver must fetch this fd from us
    os._exit(0)


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


def test_a_closed_pipe_still_ends_the_loop():
    inner, outer = CTX.Pipe(duplex=False)
    outer.close()
    with pytest.raises(EOFError):
        _TolerantRequests(inner).poll(1.0)


def test_averager_shutdown_during_a_round_finalizes_runners_and_cancels_pending_groups():
    import asyncio
    from types import SimpleNamespace

    from hivemind.averaging.averager import DecentralizedAverager

    from cotrain.swarm import fixes

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
