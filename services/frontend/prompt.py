"""A request's prompt as token ids, checked against the vocabulary and the context window."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import grpc

from mili.errors import Unavailable
from mili.tokenizer.v1 import tokenizer_pb2
from services.frontend import convert
from services.frontend.backends import Backends
from services.frontend.downstream import error_from
from services.frontend.validation import (
    Sampling,
    ValidRequest,
    check_token_ids,
    fit_context,
    with_eos,
)

# Tokenizer's name for a field -> ours (it tokenizes `text`; callers send `prompt`).
_TOKENIZER_FIELDS = {"text": "prompt"}


class Deadline:
    """The caller's deadline, handed to every downstream call as its timeout."""

    def __init__(self, time_remaining_s: float | None) -> None:
        self._at = None if time_remaining_s is None else time.monotonic() + time_remaining_s

    def remaining(self) -> float | None:
        """Seconds left (never 0: grpc treats a timeout of 0 as already expired, as it is)."""
        if self._at is None:
            return None
        return max(0.001, self._at - time.monotonic())

    @property
    def has_passed(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    sampling: Sampling  # max_tokens fitted to the context, EOS ids among the stop ids


async def tokenize(backends: Backends, request: ValidRequest, deadline: Deadline) -> Prompt:
    """Tokenize `request` (chat template for messages) and check it fits; raise InvalidArgument
    naming the field, or Unavailable when the tokenizer or every decode instance is down."""
    facts = await backends.tokenizer_facts()
    check_token_ids(request, facts.vocab_size)
    if request.prompt_field == "token_ids":
        token_ids = request.token_ids
    else:
        token_ids = await _call_tokenizer(backends, request, deadline)
    context = backends.router.max_context_tokens
    if context is None:  # no decode instance seen yet (just started?): look once more now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(backends.refresh(), timeout=backends.config.info_timeout_s + 1)
        context = backends.router.max_context_tokens
    if context is None:
        addresses = ", ".join(backends.config.decode_addresses)
        raise Unavailable(f"no decode instance is reachable (tried {addresses})")
    sampling = fit_context(
        request.sampling,
        len(token_ids),
        context,
        request.prompt_field,
        backends.router.max_prompt_tokens,
    )
    return Prompt(token_ids, with_eos(sampling, facts.eos_token_ids))


async def _call_tokenizer(
    backends: Backends, request: ValidRequest, deadline: Deadline
) -> tuple[int, ...]:
    if request.prompt_field == "messages":
        tokenize_request = tokenizer_pb2.TokenizeRequest(
            messages=convert.chat_messages(request.messages), add_generation_prompt=True
        )
        if request.enable_thinking is not None:
            tokenize_request.enable_thinking = request.enable_thinking
    else:
        tokenize_request = tokenizer_pb2.TokenizeRequest(text=request.prompt)
    who = f"tokenizer at {backends.config.tokenizer_address}"
    try:
        timeout_s = deadline.remaining() or backends.config.tokenize_timeout_s
        reply = await backends.tokenizer.Tokenize(tokenize_request, timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        if err.code() is grpc.StatusCode.UNAVAILABLE:
            backends.forget_tokenizer()
        raise error_from(
            err, who, field_names=_TOKENIZER_FIELDS, is_own_deadline_passed=deadline.has_passed
        ) from None
    return tuple(reply.token_ids)
