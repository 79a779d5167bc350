"""Reading what a server records as a call ends: a call is counted before its status goes out,
but what its handler does after (leaving flight, a cut call's count) may come a moment after
the client saw the end, so a test reads it once it is there."""

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
