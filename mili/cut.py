"""Work cut short by its own server: a drain's timeout ran out, or a second signal came.

A server that stops cancels the calls still in flight. grpc's and aiohttp's own cancellations
carry no message, so to a handler and to the request log they looked like the caller going
away ("the caller cancelled"), and the caller got whatever the transport made of it: a bare
CANCELLED or UNAVAILABLE on gRPC, an HTTP stream ending without its last chunk. Cancelled with
a `Cut`, a task's CancelledError carries why (asyncio passes `Task.cancel(msg)` on to the
error each awaiting frame sees), so the call can end with UNAVAILABLE saying so, which clients
retry elsewhere, and the log line names the server, not the caller.

A call grpc itself ended (the caller cancelled, its deadline passed) is told apart by
`cut_short`, one rule for its metrics, its log line and its span.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc

# A call grpc ends this close to its deadline ended because of it. The caller's deadline passes
# first: the server's starts when it reads the call's headers (grpc-timeout is relative), later
# by the network and the server's own queue, so when the caller's cancel arrives the server still
# has that lag left, which a loaded server makes large; a caller that leaves on its own this
# close to its deadline is rare.
_DEADLINE_SLACK_S = 0.25
# How long the calls a drain cut get to send their answer before the server closes them.
CUT_WAIT_S = 1.0


class Cut(str):
    """Why a server cut the call short: the message its caller gets (a str, so asyncio keeps
    it as the CancelledError's message)."""


def drain_ran_out(server: str, timeout_s: float) -> str:
    """What a call cut at the end of `server`'s drain is told."""
    why = f"its drain timeout ({timeout_s:g} s) ran out"
    return f"{server} stopped before this call finished: {why}"


def second_signal(server: str) -> str:
    """What a call cut by a second signal during `server`'s drain is told."""
    return f"{server} stopped before this call finished: a second signal cut its drain"


def cut(tasks: Iterable[asyncio.Task[object]], why: str) -> int:
    """Cancel each of `tasks` with `why`; returns how many were still running."""
    num_cut = 0
    for task in tasks:
        if not task.done():
            task.cancel(Cut(why))
            num_cut += 1
    return num_cut


def cut_reason(exc: BaseException) -> Cut | None:
    """The Cut a cancellation carries; None for any other (the caller's, a timeout's)."""
    if isinstance(exc, asyncio.CancelledError) and exc.args and isinstance(exc.args[0], Cut):
        return exc.args[0]
    return None


def taken_back(exc: asyncio.CancelledError) -> Cut | None:
    """For a handler that answers a cut instead of ending cancelled: the Cut, with the current
    task's cancellation undone (so a later `asyncio.timeout` in it still works); None for a
    cancellation that is not a cut (re-raise it)."""
    why = cut_reason(exc)
    task = asyncio.current_task()
    if why is not None and task is not None:
        task.uncancel()
    return why


def cut_short(remaining_s: float | None) -> grpc.StatusCode:
    """Why grpc ended a handler before it returned, from the time its call had left then
    (ServicerContext.time_remaining(): None for no deadline): DEADLINE_EXCEEDED within
    _DEADLINE_SLACK_S of the deadline, else CANCELLED (the caller went away). One rule for the
    requests' metrics, log lines and spans."""
    if remaining_s is not None and remaining_s < _DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def final_code(context: grpc.aio.ServicerContext, is_done: bool) -> grpc.StatusCode | int:
    """A server call's status as its caller sees it, once its handler ended: the code an abort
    set (ours or the servicer's; grpc keeps whatever abort was given), else OK when the handler
    returned (`is_done`), else `cut_short`'s. One rule for the call's count and its span."""
    code = context.code()
    if code is not None:
        return code
    return grpc.StatusCode.OK if is_done else cut_short(context.time_remaining())
