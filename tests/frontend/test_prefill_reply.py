"""The frontend's wait for prefill's reply or its instance's outage (clients.py): a reply that
fails as the request goes (its caller, its deadline) leaves no error unread."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from services.frontend.calls import Deadline, InstanceDown
from services.frontend.clients import _prefill_reply_or_outage


def test_a_reply_that_fails_as_the_request_goes_is_read() -> None:
    """Found by CI: a Prefill call failing DEADLINE_EXCEEDED in the same loop turn its request
    was cancelled left the failure unread: 'Task exception was never retrieved' with a
    traceback in the frontend's log."""
    unread: list[Any] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: unread.append(context))
        call: asyncio.Future[Any] = loop.create_future()
        call.set_exception(RuntimeError("prefill's deadline passed"))
        outage: asyncio.Future[InstanceDown] = loop.create_future()
        waiting = asyncio.create_task(
            _prefill_reply_or_outage(call, "prefill at x", Deadline(None), outage)
        )
        await asyncio.sleep(0)  # it starts the reply's task
        await asyncio.sleep(0)  # which fails
        waiting.cancel()  # the request goes before it woke up
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert unread == []
