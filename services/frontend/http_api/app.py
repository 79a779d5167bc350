"""The frontend's HTTP application: its routes, over the frontend's Generations.

GET  /v1/models                    the served model (OpenAI's list)
"""

from __future__ import annotations

import time

from aiohttp import web

from services.frontend.generations import Generations
from services.frontend.http_api.errors import openai_errors
from services.frontend.http_api.server import HttpConfig
from services.frontend.http_api.telemetry import add_telemetry

GENERATIONS = web.AppKey("generations", Generations)
_STARTED_AT = int(time.time())


def make_app(generations: Generations, config: HttpConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[openai_errors])
    app[GENERATIONS] = generations
    add_telemetry(app, generations.metrics)  # spans, metrics, X-Request-Id: outermost
    app.router.add_get("/v1/models", list_models)
    return app


async def list_models(request: web.Request) -> web.Response:
    model = request.app[GENERATIONS].model
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": _STARTED_AT, "owned_by": "mili"}],
        }
    )
