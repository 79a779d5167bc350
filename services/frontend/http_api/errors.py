"""Exceptions -> HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The same domain errors (mili.errors) the gRPC port maps to statuses (mili.rpc.status), mapped
once more for HTTP; validation is one rule with two mappings:

    InvalidArgument     400  invalid_request_error   param: the first bad field, in the API's names
    NotFound            404  invalid_request_error   (code model_not_found for an unknown model)
    body too large      413  invalid_request_error   code request_too_large
    ResourceExhausted   429  rate_limit_error        Retry-After: seconds, rounded up (with a
                                                     retry hint; without one it is a limit no
                                                     wait lifts: 400)
    Unavailable         503  service_unavailable_error
    DeadlineExceeded    504  timeout_error
    anything else       500  server_error, naming the exception type; the traceback is logged
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from mili import errors
from mili.cut import taken_back
from services.frontend.http_api.body import BODY_TIMEOUT_S

_LOG = logging.getLogger("mili.frontend")
ParamOf = Callable[[str], str]
# The app's body limit (web.Application's client_max_size), for the 413's message.
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_response(
    status: int,
    message: str,
    type_: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        status=status,
        text=error_body(message, type_, param, code),
        content_type="application/json",
        headers=headers,
    )


def model_not_found(name: str, served: str) -> web.Response:
    """404 for a request naming a model this server does not answer to."""
    return error_response(
        404,
        f"the model {name!r} does not exist; this server serves {served!r} (the frontend's "
        "--served-model-name sets the names it answers to)",
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


def sampling_param(field: str) -> str:
    """A validation field (the gRPC request's path, `sampling.top_p`) in the OpenAI request's
    names (`top_p`): its sampling parameters sit at the top level."""
    return field.removeprefix("sampling.")


def cut_error(exc: asyncio.CancelledError) -> errors.Unavailable:
    """A drain's cut (mili.cut) as the error the request ends with, a 503 saying why; any
    other cancellation (the client went away) is raised again."""
    why = taken_back(exc)
    if why is None:
        raise exc
    return errors.Unavailable(why)


def response_of(exc: BaseException, param_of: ParamOf = sampling_param) -> web.Response:
    """The HTTP error for an exception a request raised."""
    if isinstance(exc, errors.InvalidArgument):
        # The message names each field as the caller wrote it, as `param` names the first.
        params = [param_of(v.field) for v in exc.violations]
        message = "; ".join(
            f"{p}: {v.description}" if p else v.description
            for p, v in zip(params, exc.violations, strict=True)
        )
        return error_response(
            400, message or str(exc), "invalid_request_error", param=(params or [""])[0] or None
        )
    if isinstance(exc, errors.NotFound):
        return error_response(404, str(exc), "invalid_request_error", code="not_found")
    if isinstance(exc, errors.ResourceExhausted):
        if exc.retry_after_s is None:
            return error_response(400, str(exc), "invalid_request_error", code="limit_exceeded")
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))
        return error_response(
            429,
            str(exc),
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry_after},
        )
    if isinstance(exc, errors.Unavailable):
        return error_response(503, str(exc), "service_unavailable_error")
    if isinstance(exc, errors.DeadlineExceeded):
        return error_response(504, str(exc), "timeout_error")
    if isinstance(exc, errors.MiliError):
        return error_response(500, str(exc), "server_error")
    _LOG.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
    return error_response(
        500, f"internal error: {type(exc).__name__}: {exc}; see server log", "server_error"
    )


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error a route raises, and aiohttp's own (404 route, 405, 413 body), as OpenAI
    errors."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPRequestTimeout:
        return error_response(
            408,
            f"the request body did not arrive within {request.app[BODY_TIMEOUT_S]} s",
            "invalid_request_error",
            code="request_timeout",
        )
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            413,
            f"the request body is over this server's limit of {request.app[MAX_BODY_BYTES]} bytes",
            "invalid_request_error",
            code="request_too_large",
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(
            exc.status, f"{exc.reason}: {request.method} {request.path}", "invalid_request_error"
        )
    except RequestPayloadError as exc:  # a body that does not decode (a corrupt gzip stream)
        cause = exc.__cause__  # aiohttp's BadHttpMessage, whose message is the reason
        reason = " ".join(str(getattr(cause, "message", None) or exc).split())
        return error_response(400, f"the request body: {reason}", "invalid_request_error")
    except Exception as exc:
        return response_of(exc)
