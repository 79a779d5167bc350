"""`calls.Downstream` over gRPC: the stubs of every instance (backends.py), requests and replies
converted in convert.py, failures turned into domain errors naming the instance (downstream.py).
Decode requests share one GenerateStream per decode instance (multiplex.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from mili.errors import Unavailable
from services.frontend import convert
from services.frontend.admitter import Admitter
from services.frontend.backends import Backends
from services.frontend.calls import (
    Admitted,
    Deadline,
    InstanceDown,
    PrefillStats,
    Prompt,
    RequestIds,
    Tokenized,
    TokenizerFacts,
)
from services.frontend.downstream import error_from
from services.frontend.multiplex import RequestStream
from services.frontend.reasoning import opens_reasoning
from services.frontend.router import Route, Router
from services.frontend.text import LocalTextStream
from services.frontend.validation import ValidRequest

# Tokenizer's name for a field -> ours (it tokenizes `text`; callers send `prompt`).
_TOKENIZER_FIELDS = {"text": "prompt"}
_TOKENIZE_TIMEOUT_S = 30.0  # a Tokenize call's timeout when the caller set no deadline


class GrpcDownstream:
    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._config = backends.config
        # Tokenize calls running, by (their deadline, the request's bytes): see `tokenize`.
        self._tokenizing: dict[tuple[int, bytes], asyncio.Future[Tokenized]] = {}

    @property
    def router(self) -> Router:
        return self._backends.router

    @property
    def admitter(self) -> Admitter:
        return self._backends.admitter

    async def tokenizer_facts(self) -> TokenizerFacts:
        return await self._backends.tokenizer.current_facts()

    async def tokenize(self, request: ValidRequest, deadline: Deadline) -> Tokenized:
        """The prompt's ids. The choices of one HTTP request (n of them, under one deadline)
        ask for the same prompt at once: one call answers them all, ids and errors alike (a
        caller that goes away leaves it to the others)."""
        proto = convert.tokenize_request(request)
        # The deadline's id is unique while the call runs: the call holds the deadline.
        key = (id(deadline), proto.SerializeToString(deterministic=True))
        call = self._tokenizing.get(key)
        if call is None:
            call = asyncio.ensure_future(self._tokenize(proto, deadline))
            self._tokenizing[key] = call
            call.add_done_callback(lambda done: self._tokenized(key, done))
        return await asyncio.shield(call)

    def _tokenized(self, key: tuple[int, bytes], call: asyncio.Future[Tokenized]) -> None:
        del self._tokenizing[key]
        if not call.cancelled():
            call.exception()  # retrieved: every caller may have gone away

    async def _tokenize(self, proto: Any, deadline: Deadline) -> Tokenized:
        who = self._backends.tokenizer.who
        timeout_s = deadline.remaining() or _TOKENIZE_TIMEOUT_S
        try:
            reply = await self._backends.tokenizer.stub.Tokenize(proto, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            error = error_from(
                err, who, field_names=_TOKENIZER_FIELDS, is_own_deadline_passed=deadline.has_passed
            )
            if isinstance(error, InstanceDown):
                self._backends.forget_tokenizer()
            raise error from None
        is_chat = len(proto.messages) > 0
        return Tokenized(tuple(reply.token_ids), is_chat and opens_reasoning(reply.prompt))

    async def refresh(self) -> None:
        await self._backends.refresh()

    def request_refresh(self, down: str | None = None) -> None:
        self._backends.request_refresh(down=down)

    def decode_block_size(self, address: str) -> int:
        return self._backends.decode_layouts[address].block_size or 1

    def generate(
        self, route: Route, ids: RequestIds, prompt: Prompt, deadline: Deadline, priority: int
    ) -> RequestStream:
        layout = self._backends.prefill_layouts[route.prefill]
        request = convert.decode_request(ids, prompt, layout, self._config.kv_lease_ms, priority)
        return self._backends.instances.multiplexer(route.decode).open(request, deadline)

    def prefill(
        self,
        route: Route,
        ids: RequestIds,
        prompt: Prompt,
        admitted: Admitted,
        deadline: Deadline,
    ) -> asyncio.Future[PrefillStats]:
        request = convert.prefill_request(ids, prompt, route.decode, admitted)
        call = self._backends.instances.prefill(route.prefill).Prefill(
            request, timeout=deadline.remaining()
        )
        who = f"prefill at {route.prefill}"
        outage = self._backends.outage(route.prefill)
        task = asyncio.ensure_future(_prefill_reply_or_outage(call, who, deadline, outage))
        # Cancelling the task before it first ran would leave the call running: cancel it too.
        task.add_done_callback(lambda t: call.cancel() if t.cancelled() else None)
        return task

    def detokenize(self, vocab_size: int, deadline: Deadline) -> LocalTextStream:
        tokenizer = self._backends.tokenizer
        if tokenizer.detokenizer is None:  # facts were never fetched: the pipeline asks first
            raise Unavailable(f"{tokenizer.who}: its tokenizer file is not loaded yet")
        return tokenizer.detokenizer.stream(vocab_size)


async def _prefill_reply_or_outage(
    call: Any, who: str, deadline: Deadline, outage: asyncio.Future[InstanceDown]
) -> PrefillStats:
    """Prefill's reply, or `outage`'s error once the poller finds the instance not answering:
    a hung one (stopped, not dead) keeps its connection open, and the call would wait for its
    deadline while decode waited out its KV lease. The call is cancelled then; the request
    starts again on another prefill if it has no token yet (pipeline.py)."""
    reply = asyncio.ensure_future(_prefill_reply(call, who, deadline))
    watched: set[asyncio.Future[Any]] = {reply, outage}
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        raise outage.result()
    finally:
        if not reply.done():
            call.cancel()
            reply.cancel()
        elif not reply.cancelled():
            # Read: an error that came as the request went (its deadline, its caller) is
            # nobody's, and asyncio would log it with a traceback.
            reply.exception()


async def _prefill_reply(call: Any, who: str, deadline: Deadline) -> PrefillStats:
    try:
        return convert.prefill_stats(await call)
    except grpc.aio.AioRpcError as err:
        raise error_from(err, who, is_own_deadline_passed=deadline.has_passed) from None
