"""gRPC edge of the frontend: mili.frontend.v1.GenerationService.

Generate: validate -> tokenize -> Generation (route, hand off, stream) -> GenerateResponse.
Complete: the same deltas gathered into one CompleteResponse. Info: model, limits, instances.
Exceptions become statuses in the server interceptor (mili.rpc): INVALID_ARGUMENT with the
bad fields, RESOURCE_EXHAUSTED with RetryInfo, UNAVAILABLE naming the service that is down.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from mili.errors import ResourceExhausted
from mili.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.rpc.server import RpcServer
from services.frontend import convert
from services.frontend.backends import Backends
from services.frontend.pipeline import Delta, Generation
from services.frontend.prompt import Deadline, tokenize
from services.frontend.validation import ValidRequest, validate

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._config = backends.config
        self._num_running = 0

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        request_id, deltas = self._generate(request, context)
        # aclosing: when the caller cancels while we wait to send, the inner generators' clean-up
        # (cancelling decode and prefill calls) runs now, not when they are garbage-collected.
        async with aclosing(deltas):
            async for delta in deltas:
                yield generation_pb2.GenerateResponse(
                    request_id=request_id,
                    token_ids=delta.token_ids,
                    text=delta.text,
                    logprobs=delta.logprobs,
                    finish_reason=delta.finish_reason,  # type: ignore[arg-type]
                    usage=_usage(delta),
                )

    async def Complete(
        self, request: generation_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CompleteResponse:
        request_id, deltas = self._generate(request, context)
        reply = generation_pb2.CompleteResponse(request_id=request_id)
        texts = []
        async with aclosing(deltas):
            async for delta in deltas:
                reply.token_ids.extend(delta.token_ids)
                reply.logprobs.extend(delta.logprobs)
                texts.append(delta.text)
                if delta.finish_reason:
                    reply.finish_reason = delta.finish_reason  # type: ignore[assignment]
                    reply.usage.prompt_tokens = delta.num_prompt_tokens
                    reply.usage.completion_tokens = delta.num_completion_tokens
        reply.text = "".join(texts)
        return reply

    async def Info(
        self, request: generation_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.InfoResponse:
        router = self._backends.router
        context_tokens = router.max_context_tokens or 0
        limit = self._config.limits.max_tokens_limit or context_tokens
        return generation_pb2.InfoResponse(
            model=self._backends.model,
            max_context_tokens=context_tokens,
            max_tokens_limit=limit,
            default_max_tokens=self._config.limits.default_max_tokens,
            prefill_addresses=self._config.prefill_addresses,
            decode_addresses=self._config.decode_addresses,
        )

    def _generate(
        self,
        request: generation_pb2.GenerateRequest | generation_pb2.CompleteRequest,
        context: grpc.aio.ServicerContext,
    ) -> tuple[str, AsyncGenerator[Delta, None]]:
        """Validate now (so the request id is known), generate lazily."""
        valid = validate(convert.request_input(request), self._config.limits)
        return valid.request_id, self._run(valid, context)

    async def _run(
        self, valid: ValidRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[Delta, None]:
        if self._num_running >= self._config.max_concurrent_requests:
            raise ResourceExhausted(
                f"the frontend is running its limit of {self._config.max_concurrent_requests} "
                "requests",
                retry_after_s=self._config.retry_after_s,
            )
        self._num_running += 1
        try:
            deadline = Deadline(context.time_remaining())
            prompt = await tokenize(self._backends, valid, deadline)
            generation = Generation(self._backends, valid.request_id, prompt, deadline)
            async with aclosing(generation.run()) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self._num_running -= 1


def _usage(delta: Delta) -> generation_pb2.Usage | None:
    if not delta.finish_reason:
        return None
    return generation_pb2.Usage(
        prompt_tokens=delta.num_prompt_tokens, completion_tokens=delta.num_completion_tokens
    )


def add_to_server(server: RpcServer, servicer: GenerationServicer) -> None:
    server.add_service(
        SERVICE_NAME,
        lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s),
    )
