"""A request's prompt as token ids, checked against the vocabulary and the context window."""

from __future__ import annotations

import asyncio
import contextlib

from mili.errors import Unavailable
from services.frontend.calls import Deadline, Downstream, Prompt
from services.frontend.config import FrontendConfig
from services.frontend.validation import (
    ValidRequest,
    check_input_chars,
    check_token_ids,
    fit_context,
    with_eos,
)


async def tokenize(
    downstream: Downstream, config: FrontendConfig, request: ValidRequest, deadline: Deadline
) -> Prompt:
    """Tokenize `request` (chat template for messages) and check it fits; raise InvalidArgument
    naming the field, or Unavailable when the tokenizer or every decode instance is down."""
    facts = await downstream.tokenizer_facts()
    check_token_ids(request, facts.vocab_size)
    check_input_chars(request, facts.max_input_chars)  # refused here, not after a round trip
    if request.prompt_field == "token_ids":
        token_ids = request.token_ids
    else:
        token_ids = await downstream.tokenize(request, deadline)
    router = downstream.router
    context = router.max_context_tokens
    if context is None:  # no decode instance seen yet (just started?): look once more now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(downstream.refresh(), timeout=config.info_timeout_s + 1)
        context = router.max_context_tokens
    if context is None:
        addresses = ", ".join(config.decode_addresses)
        raise Unavailable(f"no decode instance is reachable (tried {addresses})")
    sampling = fit_context(
        request.sampling,
        len(token_ids),
        context,
        request.prompt_field,
        router.max_prompt_tokens,
        may_shrink=request.is_default_max_tokens,
    )
    return Prompt(token_ids, with_eos(sampling, facts.eos_token_ids))
