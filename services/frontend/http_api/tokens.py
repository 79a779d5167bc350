"""POST /tokenize and POST /detokenize, vLLM's utility endpoints (and TGI's /tokenize): what a
client counts a prompt with before sending it, with the server's own tokenizer and template.

    /tokenize     {"prompt": text} or {"messages": [...], "tools"?, "chat_template_kwargs"?}
                  (read as /v1/completions and /v1/chat/completions read them; the chat
                  template adds the assistant turn's opening, as vLLM's add_generation_prompt
                  default)  ->  {"count", "max_model_len", "tokens": [ids], "token_strs": null}
    /detokenize   {"tokens": [ids]}  ->  {"prompt": text}
    /v1/responses/input_tokens   a Responses request's body (OpenAI's input token count: the
                  openai SDK's responses.input_tokens.count, what LiteLLM's token counting asks
                  an `openai/` deployment)  ->  {"object": "response.input_tokens",
                  "input_tokens": the input_tokens its response would report}

Checked as a generation is (vocabulary, character limit; errors name the parameter), nothing
run. vLLM's `return_token_strs` is refused: it names BPE pieces ("Ġthe"), which this server
never shows; /detokenize gives the text.
"""

from __future__ import annotations

from aiohttp import web

from mili.errors import InvalidArgument
from services.frontend.http_api import body as bodies
from services.frontend.http_api.body import read_body
from services.frontend.http_api.completions import detokenizer_of
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.keys import GENERATIONS
from services.frontend.http_api.openai_call import other_model
from services.frontend.http_api.openai_request import (
    OpenAIRequest,
    chat_request,
    completion_request,
)
from services.frontend.http_api.responses_request import ResponsesParse
from services.frontend.http_api.telemetry import request_id_of
from services.frontend.prompt import out_of_vocabulary
from services.frontend.validation import raise_if_any


async def tokenize(request: web.Request) -> web.Response:
    generations = request.app[GENERATIONS]
    body = bodies.parse(await read_body(request))
    if body.flag("return_token_strs"):
        raise InvalidArgument("return_token_strs", True, "not supported by this server")
    if body.has("prompt") and body.has("messages"):
        raise InvalidArgument("messages", body.raw("messages"), "give prompt or messages, not both")
    read = chat_request if body.has("messages") else completion_request
    window = generations.backends.router.max_context_tokens
    asked = read(body, window, request_id_of(request))
    if len(asked.inputs) != 1:
        raise InvalidArgument("prompt", f"{len(asked.inputs)} prompts", "one prompt at a time")
    token_ids = await _token_ids(request, asked)
    if isinstance(token_ids, web.Response):
        return token_ids
    reply = {
        "count": len(token_ids),
        "max_model_len": generations.backends.router.max_context_tokens,
        "tokens": list(token_ids),
        "token_strs": None,
    }
    return web.json_response(reply)


async def count_input_tokens(request: web.Request) -> web.Response:
    """POST /v1/responses/input_tokens: read as /v1/responses reads its body (its errors name
    the Responses parameters), counted as /tokenize counts a chat."""
    window = request.app[GENERATIONS].backends.router.max_context_tokens
    body = bodies.parse(await read_body(request))
    asked = ResponsesParse()(body, window, request_id_of(request))
    token_ids = await _token_ids(request, asked)
    if isinstance(token_ids, web.Response):
        return token_ids
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(token_ids)})


async def _token_ids(request: web.Request, asked: OpenAIRequest) -> tuple[int, ...] | web.Response:
    """The ids of `asked`'s one prompt; or the error response (404 for another model)."""
    generations = request.app[GENERATIONS]
    refusal = other_model(generations, asked.model)
    if refusal is not None:
        return refusal
    try:
        return await generations.tokenize(generations.validate(asked.inputs[0]))
    except Exception as exc:
        return response_of(exc, asked.param_of)


async def detokenize(request: web.Request) -> web.Response:
    generations = request.app[GENERATIONS]
    body = bodies.parse(await read_body(request))
    refusal = other_model(generations, body.text("model"))
    if refusal is not None:
        return refusal
    if body.raw("tokens") is None:
        raise InvalidArgument("tokens", None, "required")
    token_ids = body.integers("tokens")
    try:
        detokenizer = detokenizer_of(generations)
        vocab_size = (await generations.backends.tokenizer.current_facts()).vocab_size
    except Exception as exc:
        return response_of(exc)
    raise_if_any(out_of_vocabulary(token_ids, vocab_size, "tokens"))
    return web.json_response({"prompt": detokenizer.decode(token_ids)})
