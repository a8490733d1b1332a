"""The reachability probe (cotrain.net.reachability).

Here, with hivemind in the test process; the rest in tests/unit/net/test_reachability.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import hivemind
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from conftest import LOCALHOST
from cotrain.hivemind_ext.hooks import p2p_client
from cotrain.net import reachability


class Sentinel:
    """A TCP listener that counts the connections it accepts (``silent``: accepts and never answers)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


async def ask(host: P2P, peer: PeerID, maddr: str, addresses: list[str]):
    await p2p_client(host).connect(peer, [Multiaddr(maddr)])
    request = reachability.messages().DialBackRequest(addresses="\n".join(addresses))
    return await host.call_protobuf_handler(
        peer, reachability.DIAL_BACK_HANDLE, request, reachability.messages().DialBackReply
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_probe_dials_only_the_asker_and_a_flood_leaves_an_honest_answer_within_its_limit(tmp_path: Path):
    """An answering peer on 127.0.0.1. An asker that names another host is dialed at its own address only, and
    told "not reached" with no error text. Attackers of many identities on one address keep asking it to dial
    a silent port: they hold one dial at a time and are told "busy" at once, while an honest joiner of
    another address (127.0.0.2) is answered, reached, within its limit."""
    dht = hivemind.DHT(start=True, host_maddrs=[LOCALHOST])
    reachability.serve_dial_back(dht)
    answerer = dht.get_visible_maddrs()[0]
    where, peer = str(answerer).split("/p2p/")[0], PeerID.from_base58(str(answerer).split("/p2p/")[-1])
    other_host, silent = Sentinel("127.0.0.2"), Sentinel("127.0.0.1")
    replies: list[str] = []

    async def scenario() -> float:
        # another host named: never dialed; the asker's own address at that port has nothing listening
        asker = await P2P.create(host_maddrs=[LOCALHOST], nat_port_map=False, auto_nat=False, use_relay=False)
        try:
            reply = await ask(
                asker,
                peer,
                where,
                [f"/ip4/127.0.0.2/tcp/{other_host.port}", f"/dns4/localhost/tcp/{other_host.port}"],
            )
            assert (reply.reached, reply.detail) == (False, reachability.NOT_REACHED)
        finally:
            await asker.shutdown()
        assert not other_host.accepted, "the probe dialed a host other than the asker's"

        attackers = [
            await P2P.create(host_maddrs=[LOCALHOST], nat_port_map=False, auto_nat=False, use_relay=False)
            for _ in range(3)
        ]
        stop = asyncio.Event()

        async def flood(host: P2P) -> None:
            while not stop.is_set():
                try:
                    reply = await ask(host, peer, where, [f"/ip4/127.0.0.1/tcp/{silent.port}"])
                    replies.append(reply.detail)
                except Exception as e:  # asked again too soon
                    replies.append(type(e).__name__)
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(flood(host)) for host in attackers]
        try:
            await asyncio.sleep(2.0)  # the flood is on: one of its dials is in flight
            started = time.monotonic()
            found = await asyncio.to_thread(
                reachability.dial_back, [str(answerer)], ["/ip4/127.0.0.2/tcp/0"], []
            )
            took = time.monotonic() - started
            assert found.reached is True and found.detail == "", found
            return took
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for host in attackers:
                await host.shutdown()

    try:
        took = asyncio.run(scenario())
    finally:
        other_host.close()
        silent.close()
        dht.shutdown()
    assert took < reachability.ASK_TIMEOUT
    assert reachability.BUSY in replies, replies  # the attackers' address holds one dial at a time
    assert set(replies) <= {reachability.BUSY, reachability.NOT_REACHED, "P2PHandlerError"}, set(replies)
