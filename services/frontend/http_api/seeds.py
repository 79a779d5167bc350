"""The seeds' REST endpoints, over the same Generations as gRPC and the OpenAI endpoints.

POST /generate               {"prompt": str (required), "max_tokens", "temperature", "top_p",
                              "top_k", "stream": bool, "request_id": str}
    -> 200 {"request_id", "generated_text", "tokens": [ids], "prompt_tokens",
            "completion_tokens", "total_tokens", "finish_reason"}
       total_tokens = prompt_tokens + completion_tokens (= len(tokens)): the context the
       request used. request_id: the body's, else the X-Request-Id header's, else a fresh one
       (telemetry.request_id_of: the one the response's X-Request-Id echoes).
       Unset fields take the gRPC API's defaults (the server's default max_tokens; temperature 1).
    stream: Server-Sent Events, as the OpenAI endpoints stream:
       data: {"request_id", "text", "token_ids"}               one per delta
       data: {"request_id", "finish_reason", "prompt_tokens", "completion_tokens",
              "total_tokens"}                                  the totals, last
       data: [DONE]
    Errors are OpenAI's JSON (errors.py) with the field named as here (`top_p`, not
    `sampling.top_p`); an unknown field is refused (400) rather than ignored. An error before the
    first token is the HTTP status; one after it is a `data: {"error": {...}}` event, then the
    stream ends without [DONE].

GET /status/{request_id}     a request of this frontend, whichever API ran it (request_status.py)
    -> {"request_id", "status": "processing"|"completed"|"not_found", "tokens_generated",
        "tokens_remaining", "finish_reason" (completed only: stop, length, cancelled, error)}
       tokens_remaining: max_tokens - tokens_generated while processing, 0 once completed.
       HTTP 200, or 404 with the same body for not_found: a client reading either the status
       code or the body learns the same. Ids are the callers' labels: two requests with one id
       report the newer.

GET /health                  -> {"status": "ok"|"unavailable", "model_loaded", "scheduler_ready"}
       (readiness.py defines both flags), plus "problem" when unavailable. HTTP 200 when ok,
       503 when not: the frontend's gRPC health by the same rule, and 503 while draining.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, NamedTuple

from aiohttp import web

from mili.errors import InvalidArgument
from services.frontend.calls import Deadline
from services.frontend.http_api import sse
from services.frontend.http_api.body import Body, parse, read_body
from services.frontend.http_api.choices import usage_json
from services.frontend.http_api.drain import DRAIN_GATE
from services.frontend.http_api.errors import cut_error
from services.frontend.http_api.keys import GENERATIONS
from services.frontend.http_api.telemetry import request_id_of, set_request_id
from services.frontend.pipeline import Delta
from services.frontend.validation import RequestInput, SamplingInput

_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "stream", "request_id")


class _Generate(NamedTuple):
    """A /generate body, each field read with its type (body.Body's checks)."""

    inputs: RequestInput  # its client_request_id: the body's request_id ("" when unset)
    is_stream: bool


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/status/{request_id}", status)
    app.router.add_get("/health", health)


async def generate(request: web.Request) -> web.StreamResponse:
    generations = request.app[GENERATIONS]
    given = _read(parse(await read_body(request)))
    if given.inputs.client_request_id:
        # The body's id is the request's: the response's X-Request-Id says the same.
        set_request_id(request, given.inputs.client_request_id)
    inputs = dataclasses.replace(given.inputs, client_request_id=request_id_of(request))
    valid = generations.validate(inputs)
    request_id = valid.client_request_id
    deltas = generations.run(valid, Deadline(None))
    generated = generations.metrics.generated_tokens
    async with aclosing(deltas):
        if given.is_stream:
            return await _stream(request, request_id, deltas)
        text: list[str] = []
        token_ids: list[int] = []
        last = None
        async for delta in deltas:
            text.append(delta.text)
            token_ids.extend(delta.token_ids)
            generated.inc(len(delta.token_ids))
            last = delta
    assert last is not None  # run's last delta carries finish_reason and usage
    return web.json_response(
        {
            "request_id": request_id,
            "generated_text": "".join(text),
            "tokens": token_ids,
            **_totals(last),
        }
    )


async def status(request: web.Request) -> web.Response:
    report = request.app[GENERATIONS].statuses.lookup(request.match_info["request_id"])
    body: dict[str, Any] = {
        "request_id": report.request_id,
        "status": report.status,
        "tokens_generated": report.num_generated,
        "tokens_remaining": report.num_remaining,
    }
    if report.status == "completed":
        body["finish_reason"] = report.finish_reason
    return web.json_response(body, status=404 if report.status == "not_found" else 200)


async def health(request: web.Request) -> web.Response:
    readiness = request.app[GENERATIONS].backends.readiness
    problem = readiness.problem
    if request.app[DRAIN_GATE].is_draining:
        problem = "the frontend is draining"
    body: dict[str, Any] = {
        "status": "ok" if problem is None else "unavailable",
        "model_loaded": readiness.model_loaded,
        "scheduler_ready": readiness.scheduler_ready,
    }
    if problem is not None:
        body["problem"] = problem
    return web.json_response(body, status=200 if problem is None else 503)


async def _stream(
    request: web.Request, request_id: str, deltas: AsyncGenerator[Delta, None]
) -> web.StreamResponse:
    # The first delta before the headers: a request that fails before its first token (the
    # prompt too long, a service down) answers with its HTTP status, as a plain one does.
    first = await anext(deltas)
    response = await sse.start(request)
    generated = request.app[GENERATIONS].metrics.generated_tokens
    try:
        await _send_delta(response, request_id, first)
        generated.inc(len(first.token_ids))
        last = first
        async for delta in deltas:
            await _send_delta(response, request_id, delta)
            generated.inc(len(delta.token_ids))
            last = delta
    except ConnectionError:  # the client went away: nobody to tell
        return response
    except Exception as exc:  # past the headers, the error is an event
        await sse.write_error(request, response, exc)
        return response
    except asyncio.CancelledError as exc:  # a drain's cut: said, as an error is
        await sse.write_error(request, response, cut_error(exc))
        return response
    totals = {"request_id": request_id, **_totals(last)}
    await response.write(sse.event(json.dumps(totals)) + sse.DONE)
    await response.write_eof()
    return response


async def _send_delta(response: web.StreamResponse, request_id: str, delta: Delta) -> None:
    if delta.token_ids or delta.text:
        event = {"request_id": request_id, "text": delta.text, "token_ids": delta.token_ids}
        await response.write(sse.event(json.dumps(event)))


def _totals(last: Delta) -> dict[str, Any]:
    return {
        **usage_json(last.num_prompt_tokens, last.num_completion_tokens),
        "finish_reason": None if last.finish_reason is None else last.finish_reason.value,
    }


def _read(body: Body) -> _Generate:
    for field, value in body.data.items():
        if field not in _FIELDS:
            raise InvalidArgument(
                field, value, f"unknown field; /generate takes {', '.join(_FIELDS)}"
            )
    prompt = body.text("prompt")
    if prompt is None:
        raise InvalidArgument("prompt", None, "required: the text to continue")
    inputs = RequestInput(
        client_request_id=body.text("request_id") or "",
        prompt=prompt,
        sampling=SamplingInput(
            max_tokens=body.integer("max_tokens"),
            temperature=body.number("temperature"),
            top_p=body.number("top_p"),
            top_k=body.integer("top_k"),
        ),
    )
    return _Generate(inputs, bool(body.flag("stream")))
