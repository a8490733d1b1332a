"""Helpers the test_direct tests share across suites."""

import asyncio


async def closed(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the other end closes the connection (or resets it: closed with bytes unread) within
    ``within`` seconds, without sending anything."""
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
