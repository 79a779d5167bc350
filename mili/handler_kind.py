"""A grpc.aio method handler with its behaviour wrapped. grpc drives a handler by its function's
kind (awaits a coroutine, iterates an async generator, runs a plain function in a thread), so a
wrapper must be of the kind it wraps. Shared by the RPC interceptor (mili/rpc/interceptor.py)
and the server spans (mili/telemetry/server_spans.py), which may not import each other's
layer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[[Any, Any], Any]
Wrap = Callable[[Behavior], Behavior]


def rewrapped(
    handler: grpc.RpcMethodHandler,
    wrap_generator: Wrap,
    wrap_coroutine: Wrap,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler | None:
    """`handler` with its behaviour wrapped by the wrapper of its kind (and
    `request_deserializer` instead of its own, when given); None for a plain function's
    (none of ours is one: left as is by the caller)."""
    if handler.request_streaming and handler.response_streaming:
        behavior, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    if inspect.isasyncgenfunction(behavior):
        wrapped = wrap_generator(behavior)
    elif inspect.iscoroutinefunction(behavior):
        wrapped = wrap_coroutine(behavior)
    else:
        return None
    return make(
        wrapped,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
