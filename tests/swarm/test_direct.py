"""The direct TCP path of the all-reduce (cotrain.hivemind_ext.direct).

Here, with hivemind in the test process; the rest in tests/live/test_direct.py and
tests/unit/hivemind_ext/test_direct.py."""

import asyncio

from cotrain.hivemind_ext.direct import (
    END,
    SENDER,
    TICKET_BYTES,
    DirectServer,
    Seal,
    parse_endpoint,
)
from support.direct import closed


def test_a_connection_without_a_valid_ticket_is_closed_unserved():
    from hivemind.p2p import P2P

    async def main():
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        served = []

        async def handler(stream, context):
            served.append(context.remote_id)
            yield  # pragma: no cover (never reached)

        server = DirectServer(p2p, handler)
        try:
            offer = await server.offer(p2p.peer_id)
            assert offer.endpoints and len(offer.ticket) == TICKET_BYTES and len(offer.key) == 32
            host, port = parse_endpoint(offer.endpoints[0])
            assert host == "127.0.0.1"
            for ticket in [bytes(TICKET_BYTES), offer.ticket[::-1]]:
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(ticket + Seal(offer.key, SENDER).seal(END))
                assert await closed(reader, 5)  # nothing said
                writer.close()
            assert served == [] and offer.ticket in server.tickets
        finally:
            server.close()
            await p2p.shutdown()

    asyncio.run(main())
