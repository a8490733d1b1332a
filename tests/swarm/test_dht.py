"""The DHT process's request pipe: requests from processes that have exited are dropped, not fatal; a
process's reply pipe crosses once, not with every request. The libp2p daemon's garbage collection."""


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
