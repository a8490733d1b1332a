"""Self-healing membership.

Here, with hivemind in the test process; the rest in tests/live/test_partition.py."""

from __future__ import annotations

import pytest

from conftest import LOCALHOST

pytestmark = [pytest.mark.slow]


async def _table_size(dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _lose_every_link(dht, node) -> None:
    """What hivemind does to a peer whose requests fail: drop it from the routing table (and here, also
    close the connection to it)."""
    table = node.protocol.routing_table
    for node_id, peer_id in list(table.uid_to_peer_id.items()):
        del table[node_id]
        await node.p2p._client.disconnect(peer_id)


@pytest.mark.timeout(240)  # seconds on an idle machine; the limit is for a loaded one
def test_the_healer_brings_back_a_peer_that_lost_every_link():
    import threading

    import hivemind
    from hivemind.utils.timed_storage import get_dht_time

    from cotrain.net.healing import SwarmHealer

    first = hivemind.DHT(host_maddrs=[LOCALHOST], start=True)
    second = None
    try:
        initial = [str(a) for a in first.get_visible_maddrs()]
        second = hivemind.DHT(initial_peers=initial, host_maddrs=[LOCALHOST], start=True)
        assert second.run_coroutine(_table_size) == 1
        for dht in (first, second):
            dht.run_coroutine(_lose_every_link)
        expiration = get_dht_time() + 60
        assert first.store("written-while-apart", 1, expiration)  # lands only in first's own storage
        assert second.get("written-while-apart", latest=True) is None  # alone: nobody to ask
        assert second.run_coroutine(_table_size) == 0 and first.run_coroutine(_table_size) == 0

        healer = SwarmHealer(second, initial, threading.Event(), isolated_after=0.0)
        healer.check()  # no peer answers -> cut off -> dials its initial peer -> back

        assert healer.isolations == 1 and healer.rejoins == 1 and not healer.isolated
        assert second.run_coroutine(_table_size) == 1
        assert first.run_coroutine(_table_size) == 1  # the peer it reached took it back too
        found = second.get("written-while-apart", latest=True)
        assert found is not None and found.value == 1
    finally:
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()
