"""gRPC edge of the frontend: mili.frontend.v1.GenerationService.

Generate: validate -> Generations.run (tokenize, route, hand off, stream; generations.py) ->
GenerateResponse, several deltas in one when the client lags (coalescer.py).
Complete: the same deltas gathered into one CompleteResponse. Info: model, limits, instances.
Tokenize: validate -> Generations.tokenize (the prompt's ids, nothing run).
A chat request's text is split into reasoning, answer and tool calls (chat_output.py, the same
code the HTTP API runs).
Exceptions become statuses in the server interceptor (mili.rpc): INVALID_ARGUMENT with the
bad fields, RESOURCE_EXHAUSTED with RetryInfo, UNAVAILABLE naming the service that is down.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

import grpc

from mili import __version__
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.rpc.policy import Policy
from mili.rpc.server import RpcServer
from services.frontend import convert
from services.frontend.calls import Deadline
from services.frontend.chat_output import ChatOutput
from services.frontend.coalescer import coalesced
from services.frontend.generations import Generations
from services.frontend.http_api.telemetry import is_header_safe
from services.frontend.pipeline import Delta
from services.frontend.prompt import sampling_defaults
from services.frontend.validation import ValidRequest

# gRPC metadata keys are lower case (HTTP/2): the HTTP API's X-Request-Id
REQUEST_ID_METADATA = "x-request-id"
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, generations: Generations) -> None:
        self._generations = generations
        self._backends = generations.backends
        self._metrics = generations.metrics
        self._config = generations.config

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        valid, deltas = self._generate(request, context)
        client_request_id, output = valid.client_request_id, _chat_output(valid)
        # A client that reads slower than tokens come gets everything pending in one message.
        merged = coalesced(
            deltas,
            max_buffered_tokens=self._config.max_buffered_tokens,
            stream_interval=self._config.stream_interval,
        )
        # aclosing: when the caller cancels while we wait to send, the inner generators' clean-up
        # (cancelling decode and prefill calls) runs now, not when they are garbage-collected.
        generated_tokens = self._metrics.generated_tokens
        async with aclosing(merged):
            async for delta in merged:
                yield convert.generate_response(client_request_id, delta, output)
                # Resumed once grpc took the message: counted once per message sent.
                if delta.token_ids:
                    generated_tokens.inc(len(delta.token_ids))

    async def Complete(
        self, request: generation_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CompleteResponse:
        valid, deltas = self._generate(request, context)
        async with aclosing(deltas):
            response = convert.complete_response(
                valid.client_request_id, [delta async for delta in deltas], _chat_output(valid)
            )
        self._metrics.generated_tokens.inc(len(response.token_ids))
        return response

    async def Info(
        self, request: generation_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.InfoResponse:
        router = self._backends.router
        context_tokens = router.max_context_tokens or 0
        limit = self._config.limits.max_tokens_limit or context_tokens
        members = router.members()
        return generation_pb2.InfoResponse(
            model=self._backends.model,
            max_context_tokens=context_tokens,
            max_tokens_limit=limit,
            default_max_tokens=self._config.limits.default_max_tokens or 0,
            prefill_addresses=[m.address for m in members if m.kind == "prefill"],
            decode_addresses=[m.address for m in members if m.kind == "decode"],
            prefill_targets=[t.spec for t in self._backends.instances.targets("prefill")],
            decode_targets=[t.spec for t in self._backends.instances.targets("decode")],
            instances=[
                convert.instance(m, self._backends.instances.target_of(m.address)) for m in members
            ],
            target_problems=[
                generation_pb2.TargetProblem(target=t.spec, problem=problem)
                for t, problem in self._backends.lookup_problems.by_target.items()
            ],
            server_version=__version__,
            sampling_defaults=convert.sampling_defaults(
                sampling_defaults(self._config, self._backends.tokenizer.facts)
            ),
        )

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        window = self._backends.router.max_context_tokens
        given = convert.tokenize_input(request, window)
        if not given.client_request_id:
            given = replace(given, client_request_id=_header_request_id(context))
        valid = self._generations.validate(given)
        return generation_pb2.TokenizeResponse(
            request_id=valid.client_request_id,
            token_ids=await self._generations.tokenize(valid),
            max_context_tokens=self._backends.router.max_context_tokens or 0,
        )

    def _generate(
        self,
        request: generation_pb2.GenerateRequest | generation_pb2.CompleteRequest,
        context: grpc.aio.ServicerContext,
    ) -> tuple[ValidRequest, AsyncGenerator[Delta, None]]:
        """Validate now (so the caller's request id is known), generate lazily."""
        window = self._backends.router.max_context_tokens
        given = convert.request_input(request, window)
        if not given.client_request_id:
            given = replace(given, client_request_id=_header_request_id(context))
        valid = self._generations.validate(given)
        deadline = Deadline(context.time_remaining())
        return valid, self._generations.run(valid, deadline)


def _header_request_id(context: grpc.aio.ServicerContext) -> str:
    """The call's `x-request-id` metadata when it is printable ASCII (as the HTTP API takes
    its X-Request-Id), else "" (a fresh id): the id a gateway (Envoy, an ingress) gave the
    call, so that its logs and MILI's name the request alike when `request_id` is empty."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA and isinstance(value, str):
            return value if is_header_safe(value) else ""
    return ""


def _chat_output(valid: ValidRequest) -> ChatOutput | None:
    """A chat request's output splitter; None for prompt and token_ids requests (not split)."""
    if valid.prompt_field != "messages":
        return None
    return ChatOutput.of(valid)


def add_to_server(server: RpcServer, servicer: GenerationServicer) -> None:
    """Register GenerationService: the public API, open to any caller; Generate, Complete and
    Tokenize take requests up to the server's receive limit (--max-receive-message-bytes), Info
    a few bytes."""
    limit = server.config.receive_limit
    policy = Policy(max_request_bytes={"Generate": limit, "Complete": limit, "Tokenize": limit})
    server.add_service(
        SERVICE_NAME,
        lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s),
        policy,
    )
