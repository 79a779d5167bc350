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

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from mili.errors import InvalidArgument
from services.frontend.calls import Deadline
from services.frontend.http_api import sse
from services.frontend.http_api.body import parse
from services.frontend.http_api.drain import DRAIN_GATE
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.keys import GENERATIONS
from services.frontend.http_api.telemetry import request_id_of, set_request_id, stream_failed
from services.frontend.pipeline import Delta
from services.frontend.validation import RequestInput, SamplingInput

# Field -> the JSON types it accepts (bool is refused where a number is meant: JSON true is
# not 1).
_FIELDS: dict[str, tuple[type, ...]] = {
    "prompt": (str,),
    "max_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "stream": (bool,),
    "request_id": (str,),
}


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/status/{request_id}", status)
    app.router.add_get("/health", health)


async def generate(request: web.Request) -> web.StreamResponse:
    generations = request.app[GENERATIONS]
    body = await _json_object(request)
    if body.get("request_id"):  # a string: _json_object checked it
        # The body's id is the request's: the response's X-Request-Id says the same.
        set_request_id(request, body["request_id"])
    valid = generations.validate(_request_input(body, request_id_of(request)))
    request_id = valid.client_request_id
    deltas = generations.run(valid, Deadline(None))
    generated = generations.metrics.generated_tokens
    async with aclosing(deltas):
        if body.get("stream", False):
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
        error = response_of(exc)
        stream_failed(request, error.status)
        await response.write(sse.event(error.text or "{}"))
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
    num_prompt, num_completion = last.num_prompt_tokens, last.num_completion_tokens
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "finish_reason": None if last.finish_reason is None else last.finish_reason.value,
    }


async def _json_object(request: web.Request) -> dict[str, Any]:
    body = parse(await request.read()).data  # the OpenAI routes' checks (a lone surrogate)
    for field, value in body.items():
        types = _FIELDS.get(field)
        if types is None:
            raise InvalidArgument(
                field, value, f"unknown field; /generate takes {', '.join(_FIELDS)}"
            )
        if value is not None and (
            not isinstance(value, types) or (bool not in types and isinstance(value, bool))
        ):
            names = " or ".join("number" if t is float else t.__name__ for t in types)
            raise InvalidArgument(field, value, f"must be {names}")
    if not isinstance(body.get("prompt"), str):
        raise InvalidArgument("prompt", None, "required: the text to continue")
    return body


def _request_input(body: dict[str, Any], request_id: str) -> RequestInput:
    return RequestInput(
        client_request_id=request_id,
        prompt=body["prompt"],
        sampling=SamplingInput(
            max_tokens=body.get("max_tokens"),
            temperature=_float(body.get("temperature")),
            top_p=_float(body.get("top_p")),
            top_k=body.get("top_k"),
        ),
    )


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)
