"""The frontend's HTTP application: its routes, over the frontend's Generations.

GET  /v1/models                    the served model (OpenAI's list), under each served name
GET  /v1/models/{model}            one of them (the SDK's models.retrieve)
GET  /version                      {"version": MILI's version}, as vLLM answers it
POST /v1/completions               text completions (completions.py)
POST /v1/chat/completions          chat completions (chat.py)
POST /v1/responses                 OpenAI's Responses API, stateless (responses.py); a stored
                                   one asked for by id (GET, DELETE, .../cancel, .../input_items)
                                   is 404, saying none is kept
POST /v1/responses/input_tokens    what a Responses request's input counts (tokens.py)
POST /tokenize, POST /detokenize   a prompt's token ids, ids' text, as vLLM has them (tokens.py)
POST /generate, GET /status/{request_id}, GET /health    the seeds' endpoints (seeds.py)
GET  /metrics                      this frontend's Prometheus metrics, as vLLM serves its own on
                                   its API port (aiperf looks there); 404 naming --metrics-port
                                   where sibling frontends share the port (--frontends N): a
                                   scrape would reach any one of them

Every route's errors are OpenAI's JSON (errors.py); while the frontend drains, new POSTs are
refused with 503 and /health says 503 (drain.py).
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from mili import __version__
from services.frontend.generations import Generations
from services.frontend.http_api import seeds
from services.frontend.http_api.body import BODY_TIMEOUT_S
from services.frontend.http_api.chat import create_chat_completion
from services.frontend.http_api.completions import create_completion
from services.frontend.http_api.drain import DRAIN_GATE, DrainGate
from services.frontend.http_api.errors import (
    MAX_BODY_BYTES,
    error_response,
    model_not_found,
    openai_errors,
)
from services.frontend.http_api.keys import GENERATIONS
from services.frontend.http_api.responses import create_response
from services.frontend.http_api.server import HttpConfig
from services.frontend.http_api.telemetry import add_telemetry
from services.frontend.http_api.tokens import count_input_tokens, detokenize, tokenize

_STARTED_AT = int(time.time())


def make_app(generations: Generations, config: HttpConfig) -> web.Application:
    gate = DrainGate()
    # The gate inside the errors: its refusal is an OpenAI error too.
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[openai_errors, gate.middleware()]
    )
    app[GENERATIONS] = generations
    app[DRAIN_GATE] = gate
    app[MAX_BODY_BYTES] = config.max_body_bytes
    app[BODY_TIMEOUT_S] = config.body_timeout_s
    add_telemetry(app, generations.metrics)  # spans, metrics, X-Request-Id: outermost
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # names may hold a "/"
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    # Before the stored responses' route, whose {response_id} it would otherwise be
    app.router.add_post("/v1/responses/input_tokens", count_input_tokens)
    for method in ("GET", "DELETE", "POST"):
        app.router.add_route(method, "/v1/responses/{response_id}{rest:(/.*)?}", stored_response)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", shared_port_metrics if config.reuse_port else metrics)
    seeds.add_routes(app)
    return app


def _card(name: str, generations: Generations) -> dict[str, object]:
    """OpenAI's model object, with vLLM's `root` (the served model's reported name) and
    `max_model_len` (the context window, prompt and output; null until a decode instance is
    known), which clients read to size their requests."""
    backends = generations.backends
    return {
        "id": name,
        "object": "model",
        "created": _STARTED_AT,
        "owned_by": "mili",
        "root": backends.model,
        "parent": None,
        "max_model_len": backends.router.max_context_tokens,
    }


async def list_models(request: web.Request) -> web.Response:
    """The served model under each name it answers to, the reported one first."""
    generations = request.app[GENERATIONS]
    cards = [_card(n, generations) for n in generations.backends.model_names]
    return web.json_response({"object": "list", "data": cards})


async def retrieve_model(request: web.Request) -> web.Response:
    backends = request.app[GENERATIONS].backends
    name = request.match_info["model"]
    # Any name a request may give (a path or hub id ending in a served name too), once known.
    if not (backends.model and backends.answers_to(name)):
        return model_not_found(name, backends.model)
    return web.json_response(_card(name, request.app[GENERATIONS]))


async def stored_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    return error_response(
        404,
        f"no response {response_id!r}: this server keeps no responses (store is answered "
        "false); send the whole conversation in each request's input",
        "invalid_request_error",
        code="not_found",
    )


async def metrics(request: web.Request) -> web.Response:
    """The registry the frontend's --metrics-port serves (gRPC, HTTP, generations, process),
    read on the event loop (a few dozen series)."""
    registry = request.app[GENERATIONS].metrics.registry
    # The format the scraper accepts (OpenMetrics or Prometheus text), as --metrics-port picks.
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return web.Response(body=encode(registry), headers={"Content-Type": content_type})


async def shared_port_metrics(request: web.Request) -> web.Response:
    return error_response(
        404,
        "this HTTP port is shared by several frontend processes (--frontends), so a scrape "
        "here would reach any one of them: scrape each frontend's --metrics-port",
        "invalid_request_error",
        code="not_found",
    )


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def completions(request: web.Request) -> web.StreamResponse:
    return await create_completion(request, request.app[GENERATIONS])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await create_chat_completion(request, request.app[GENERATIONS])


async def responses(request: web.Request) -> web.StreamResponse:
    return await create_response(request, request.app[GENERATIONS])
