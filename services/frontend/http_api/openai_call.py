"""What both OpenAI generation endpoints do before and after their own shaping: read the body,
check the model, validate every choice; then respond, streaming the choices' deltas as SSE
(sse.py) or gathering them into one JSON body, in the endpoint's shape.

    X-Request-Id header  -> the request id in logs and traces, and the response's id
                            (`cmpl-`/`chatcmpl-` + it); a fresh one when absent
                            (telemetry.request_id_of: the one the response header echoes)
    model                -> the served one, or unset or ""; another is 404 model_not_found

A whole body with many logprob entries (vLLM's prompt_logprobs 20 of a long prompt: megabytes of
JSON) is built in a worker thread, not on the event loop every other request of this process
is served from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from mili.engine.logprobs import TokenLogprobs
from mili.errors import ResourceExhausted
from services.frontend.generations import Generations
from services.frontend.http_api import body, sse
from services.frontend.http_api.body import read_body
from services.frontend.http_api.choices import Choice, plan, run
from services.frontend.http_api.errors import model_not_found, response_of
from services.frontend.http_api.openai_request import OpenAIRequest
from services.frontend.http_api.telemetry import request_id_of
from services.frontend.pipeline import Delta

_LOG = logging.getLogger("mili.frontend")
Parse = Callable[[body.Body, int | None, str], OpenAIRequest]


@dataclass(frozen=True)
class Head:
    """What every response and chunk of a call starts with."""

    request_id: str  # the caller's X-Request-Id, or a fresh one
    created: int  # Unix seconds
    model: str

    def json(self, prefix: str, object_: str) -> dict[str, object]:
        return {
            "id": f"{prefix}-{self.request_id}",
            "object": object_,
            "created": self.created,
            "model": self.model,
        }


@dataclass(frozen=True)
class OpenAICall:
    generations: Generations
    request: OpenAIRequest
    choices: list[Choice]
    head: Head


def other_model(generations: Generations, model: str | None) -> web.Response | None:
    """The 404 for a request naming a model this server does not answer to; None when it names
    a served one, or none ("" is "the served one" too, as vLLM takes it: some clients and tools
    send it)."""
    if model and not generations.backends.answers_to(model):
        return model_not_found(model, generations.model)
    return None


async def open_call(
    http_request: web.Request, generations: Generations, parse: Parse
) -> OpenAICall | web.Response:
    """The call, its choices validated; or the error response (400 naming the parameter, 404
    for another model). InvalidArgument of the body's types is raised in the caller's names."""
    request_id = request_id_of(http_request)
    window = generations.backends.router.max_context_tokens
    request = parse(body.parse(await read_body(http_request)), window, request_id)
    refusal = other_model(generations, request.model)
    if refusal is not None:
        return refusal
    if request.user is not None:
        _LOG.debug("request %s is from user %r", request_id, request.user[:200])  # any size
    try:
        choices = plan(generations, request)
    except Exception as exc:
        return response_of(exc, request.param_of)
    return OpenAICall(
        generations, request, choices, Head(request_id, int(time.time()), generations.model)
    )


class Shape(sse.Chunks, Protocol):
    """An endpoint's response JSON: as stream chunks (sse.Chunks), or whole."""

    # How many times a whole body shows each prompt token's logprobs (the first choice of each
    # prompt carries them: choices.plan)
    prompt_logprobs_copies: int

    def whole(self, deltas: dict[int, list[Delta]]) -> str: ...


async def respond(http_request: web.Request, call: OpenAICall, shape: Shape) -> web.StreamResponse:
    """The call's response: its choices streamed as SSE, or gathered into one JSON body."""
    if call.request.is_stream:
        events = run(call.generations, call.choices, is_stream=True)
        metric = call.generations.metrics.generated_tokens
        return await sse.serve(http_request, events, shape, call.request.param_of, metric)
    deltas = await _gather(call, shape.prompt_logprobs_copies)
    if isinstance(deltas, web.Response):
        return deltas
    return web.Response(text=await whole_body(shape, deltas), content_type="application/json")


# Logprob entries (prompt and generated tokens', each with its top ones) past which a whole
# body is built in a worker thread: its JSON grows with them, and built on the loop it would
# hold up every stream and request this process serves until done (the GIL lets the loop run
# between the thread's bytecodes). Below it, the thread's hop would cost more than it saves.
MAX_LOOP_LOGPROBS = 1024


async def whole_body(shape: Shape, deltas: dict[int, list[Delta]]) -> str:
    """`shape.whole(deltas)`, off the event loop when the body is a large one."""
    num_logprobs = sum(
        len(d.logprobs) + len(d.prompt_logprobs or ()) for ds in deltas.values() for d in ds
    )
    if num_logprobs <= MAX_LOOP_LOGPROBS:
        return shape.whole(deltas)
    return await asyncio.to_thread(shape.whole, deltas)


# Logprob entries (a token's own and each of its top ones, counted in every place the body shows
# them) a whole body may hold. Past it the request fails (400, limit_exceeded) and its
# generations are cancelled: n 128 x 4,096 tokens x 21 would be 11M entries, hundreds of MB of
# JSON and several times that in objects, in the process that serves every other request. A
# stream sends generated tokens' logprobs as they come, so holds none of them.
MAX_WHOLE_LOGPROBS = 1 << 20


async def _gather(call: OpenAICall, prompt_copies: int) -> dict[int, list[Delta]] | web.Response:
    """Every choice's deltas, by choice index, once all finished; or the error response.
    `prompt_copies`: how many times the body shows each prompt token's logprobs."""
    deltas: dict[int, list[Delta]] = {c.index: [] for c in call.choices}
    events = run(call.generations, call.choices, is_stream=False)
    generated = call.generations.metrics.generated_tokens
    left = MAX_WHOLE_LOGPROBS
    try:
        async with aclosing(events):
            async for index, delta in events:
                deltas[index].append(delta)
                left -= _entries(delta.logprobs)
                left -= prompt_copies * _entries(delta.prompt_logprobs or ())
                if left < 0:
                    raise ResourceExhausted(
                        f"the response would hold over {MAX_WHOLE_LOGPROBS:,} logprob entries "
                        "(each token's and its top ones, in every choice that shows them); ask "
                        "for fewer choices, tokens or top logprobs, or stream the generated "
                        "tokens' (stream: true)"
                    )
    except Exception as exc:
        return response_of(exc, call.request.param_of)
    generated.inc(sum(len(d.token_ids) for ds in deltas.values() for d in ds))
    return deltas


def _entries(logprobs: Sequence[TokenLogprobs]) -> int:
    return sum(1 + len(lp.top) for lp in logprobs)
