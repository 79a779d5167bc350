"""Server-sent events as OpenAI's streaming endpoints frame them.

    HTTP/1.1 200 OK
    Content-Type: text/event-stream
    (chunked body)
    data: {"id": ..., "choices": [...]}\\n\\n      one event per chunk, one line of JSON each
    ...
    data: [DONE]\\n\\n                              the end (after an error event too, as vLLM)

Writes go through aiohttp's StreamResponse.write, which waits while the transport's buffer is
full: a client that reads slowly slows its own stream (the coalescer merges what piles up
meanwhile) instead of growing a buffer here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Protocol

from aiohttp import web
from prometheus_client import Counter

from services.frontend.http_api.errors import ParamOf, cut_error, response_of, sampling_param
from services.frontend.http_api.telemetry import stream_failed
from services.frontend.pipeline import Delta

DONE = b"data: [DONE]\n\n"
_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # a proxy in front (nginx) passes events on at once
}


def event(json_text: str) -> bytes:
    """One event carrying one JSON document (json.dumps never writes a newline)."""
    return b"data: " + json_text.encode() + b"\n\n"


async def start(request: web.Request) -> web.StreamResponse:
    """The response's status and headers, sent: from here on errors go in the stream."""
    response = web.StreamResponse(headers=_HEADERS)
    await response.prepare(request)
    return response


class Chunks(Protocol):
    """An endpoint's chunks, as JSON text: what opens the stream (sent with the first delta,
    None when it ended without one), each delta's, what closes it, and the event an error
    after the headers is (`error`: the body its HTTP response would have had)."""

    def opening(self, first: Delta | None) -> list[str]: ...

    def of(self, index: int, delta: Delta) -> list[str]: ...

    def closing(self) -> list[str]: ...

    def failed(self, error: str) -> str: ...


async def serve(
    request: web.Request,
    events: AsyncGenerator[tuple[int, Delta], None],
    chunks: Chunks,
    param_of: ParamOf,
    generated_tokens: Counter,
) -> web.StreamResponse:
    """Stream the choices' deltas (`events`) as SSE. The headers wait for the first delta, so
    that what fails before any token (a full queue, a prompt too long for the context) is an
    HTTP error with its status; an error after is an error event, then [DONE]. A client that
    goes away ends the stream: closing `events` cancels every generation."""
    async with aclosing(events):
        try:
            first = await anext(events, None)
        except Exception as exc:
            return response_of(exc, param_of)
        response = await start(request)
        try:
            for text in chunks.opening(None if first is None else first[1]):
                await response.write(event(text))
            if first is not None:
                await _write(response, chunks, *first, generated_tokens)
            try:
                async for index, delta in events:
                    await _write(response, chunks, index, delta, generated_tokens)
            except ConnectionResetError:
                raise
            except Exception as exc:
                await write_error(request, response, exc, param_of, chunks.failed)
            except asyncio.CancelledError as exc:  # a drain's cut: said, as an error is
                await write_error(request, response, cut_error(exc), param_of, chunks.failed)
            else:
                for text in chunks.closing():
                    await response.write(event(text))
            await response.write(DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away; leaving closes the generations
    return response


async def write_error(
    request: web.Request,
    response: web.StreamResponse,
    exc: Exception,
    param_of: ParamOf = sampling_param,
    failed: Callable[[str], str] = str,
) -> None:
    """The event a stream whose headers went out ends with (before its [DONE]): the error
    body its HTTP response would have had, as `failed` frames it (as it is by default)."""
    error = response_of(exc, param_of)
    stream_failed(request, error.status)
    await response.write(event(failed(error.text or "{}")))


async def _write(
    response: web.StreamResponse, chunks: Chunks, index: int, delta: Delta, generated: Counter
) -> None:
    for text in chunks.of(index, delta):
        await response.write(event(text))
    if delta.token_ids:
        generated.inc(len(delta.token_ids))  # once written, as the gRPC servicer counts
