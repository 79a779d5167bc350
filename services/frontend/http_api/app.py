"""The frontend's HTTP application: its routes, over the frontend's Generations.

GET  /v1/models                    the served model (OpenAI's list)
POST /v1/completions               text completions (completions.py)
POST /v1/chat/completions          chat completions (chat.py)
"""

from __future__ import annotations

import time

from aiohttp import web

from services.frontend.generations import Generations
from services.frontend.http_api.chat import create_chat_completion
from services.frontend.http_api.completions import create_completion
from services.frontend.http_api.errors import openai_errors
from services.frontend.http_api.server import HttpConfig

GENERATIONS = web.AppKey("generations", Generations)
_STARTED_AT = int(time.time())


def make_app(generations: Generations, config: HttpConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[openai_errors])
    app[GENERATIONS] = generations
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app


async def list_models(request: web.Request) -> web.Response:
    model = request.app[GENERATIONS].model
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": _STARTED_AT, "owned_by": "mili"}],
        }
    )


async def completions(request: web.Request) -> web.StreamResponse:
    return await create_completion(request, request.app[GENERATIONS])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await create_chat_completion(request, request.app[GENERATIONS])
