"""Reading what a server records after its reply: a status reaches the client a moment before
the server's interceptor counts the call, so a test reads the count once it is there."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(read: Callable[[], float], timeout_s: float = 2.0) -> float:
    """`read()` once it is non-zero, or when `timeout_s` has passed (then whatever it is)."""
    for _ in range(int(timeout_s / 0.01)):
        if read():
            break
        await asyncio.sleep(0.01)
    return read()
