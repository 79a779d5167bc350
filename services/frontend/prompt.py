"""A request's prompt as token ids, checked against what the services behind it report: the
tokenizer's vocabulary and character limit, prefill's prompt limit, the context window; the
model's EOS ids join its stop ids, and its constraint goes behind the think block the rendered
prompt leaves the model.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mili.engine.sampling_params import SamplingParams
from mili.errors import FieldViolation, InvalidArgument, Unavailable, count_of
from mili.plural import plural
from services.frontend import tools as tool_checks
from services.frontend.calls import Deadline, Downstream, Prompt, Tokenized, TokenizerFacts
from services.frontend.config import FrontendConfig
from services.frontend.reasoning import think_block
from services.frontend.validation import PromptField, ValidRequest, raise_if_any


async def tokenize(
    downstream: Downstream, config: FrontendConfig, request: ValidRequest, deadline: Deadline
) -> Prompt:
    """Tokenize `request` (chat template for messages) and check it fits; raise InvalidArgument
    naming the field, or Unavailable when the tokenizer or every decode instance is down."""
    facts = await downstream.tokenizer_facts()
    check_token_ids(request, facts.vocab_size)
    check_input_chars(request, facts.max_input_chars)  # refused here, not after a round trip
    if request.prompt_field == "token_ids":
        tokenized = Tokenized(request.token_ids)
    else:
        tokenized = await downstream.tokenize(request, deadline)
    token_ids = tokenized.token_ids
    router = downstream.router
    context = router.max_context_tokens
    if context is None:  # no decode instance seen yet (just started?): look once more now
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(config.info_timeout_s + 1):
                await downstream.refresh()
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
    if request.is_default_max_tokens:
        sampling = _fit_pool(sampling, len(token_ids), _largest_pool(downstream))
    sampling = with_defaults(sampling, request.unset_sampling, sampling_defaults(config, facts))
    sampling = with_eos(sampling, facts.eos_token_ids)
    sampling = with_think_block(sampling, request, tokenized.starts_in_reasoning)
    return Prompt(token_ids, sampling, facts.vocab_size, tokenized.starts_in_reasoning)


def with_think_block(
    sampling: SamplingParams, request: ValidRequest, starts_in_reasoning: bool
) -> SamplingParams:
    """The constraint (if any) behind the think block the prompt leaves the model
    (reasoning.think_block): known once the chat template has rendered the prompt."""
    if sampling.constraint is None:
        return sampling
    is_chat = request.prompt_field == "messages"
    think = think_block(is_chat, request.enable_thinking, starts_in_reasoning)
    return replace(sampling, constraint=sampling.constraint.after_think(think))


def _largest_pool(downstream: Downstream) -> int | None:
    """Token positions the largest routable decode instance's KV pool holds (Info), or None
    while none said."""
    pools = [
        view.num_total_blocks * downstream.decode_block_size(view.address)
        for view in downstream.router.decodes.values()
        if view.is_routable and view.num_total_blocks > 0
    ]
    return max(pools, default=None)


def _fit_pool(sampling: SamplingParams, num_prompt_tokens: int, pool: int | None) -> SamplingParams:
    """A default max_tokens (the caller left it unset) shrunk to what the largest decode pool
    holds after the prompt, as to the context: on a small pool the default alone made the
    request too large, refused naming a max_tokens the caller never sent. A prompt that
    leaves no room is left to the placement's refusal (it names what is needed)."""
    if pool is None:
        return sampling
    room = pool - num_prompt_tokens + 1  # positions prompt + max_tokens - 1 (blocks_at_longest)
    if 1 <= room < sampling.max_tokens and sampling.min_tokens <= room:
        return replace(sampling, max_tokens=room)
    return sampling


def check_input_chars(request: ValidRequest, max_input_chars: int) -> None:
    """The text the tokenizer would refuse, refused before sending it (0: no known limit).
    Counted as the tokenizer counts: the prompt, or the messages' content, reasoning, tool
    calls and call ids, and the tools."""
    if request.prompt_field == "prompt":
        num_chars = len(request.prompt)
    elif request.prompt_field == "messages":
        num_chars = sum(
            len(m.content) + len(m.reasoning_content or "") + len(m.tool_call_id)
            for m in request.messages
        )
        calls = [c for m in request.messages for c in m.tool_calls]
        num_chars += tool_checks.num_chars(request.tools, calls)
    else:
        return
    if max_input_chars and num_chars > max_input_chars:
        raise InvalidArgument(
            request.prompt_field,
            count_of(num_chars, "character"),
            f"longer than the tokenizer's limit of {max_input_chars} characters",
        )


def out_of_vocabulary(
    token_ids: Sequence[int], vocab_size: int, field: str
) -> list[FieldViolation]:
    """A violation for each id of `field` (`field[i]`) outside the tokenizer's vocabulary."""
    reason = f"outside the vocabulary (ids 0..{vocab_size - 1})"
    return [
        FieldViolation.of(f"{field}[{i}]", token_id, reason)
        for i, token_id in enumerate(token_ids)
        if not 0 <= token_id < vocab_size
    ]


def check_token_ids(request: ValidRequest, vocab_size: int) -> None:
    """Every id the caller sent (prompt, stop ids, logit_bias) must be below the tokenizer's
    vocab size."""
    violations = out_of_vocabulary(request.token_ids, vocab_size, "token_ids")
    try:
        request.sampling.check_vocabulary(vocab_size)  # the rule prefill and decode apply too
    except InvalidArgument as err:
        violations += [FieldViolation(f"sampling.{v.field}", v.description) for v in err.violations]
    raise_if_any(violations)


def fit_context(
    sampling: SamplingParams,
    num_prompt_tokens: int,
    max_context_tokens: int,
    prompt_field: PromptField,
    max_prompt_tokens: int | None = None,
    *,
    may_shrink: bool = False,
) -> SamplingParams:
    """Check prompt + max_tokens fits the context window; with `may_shrink` (the caller left
    max_tokens unset) max_tokens shrinks to fit instead.

    Raises InvalidArgument naming the prompt (when it alone is too long for prefill, or leaves
    no room for one token), `sampling.max_tokens`, or `sampling.prompt_logprobs` (asked for a
    prompt longer than their limit), with the numbers a caller needs to fix it. A context
    overflow says "this model's maximum context length is N tokens", as vLLM and OpenAI word
    it: gateways (LiteLLM) recognize an overflow by those words alone, to fall back to a model
    with a longer context or have the client compact its conversation.
    """
    if num_prompt_tokens == 0:
        raise InvalidArgument(prompt_field, "", "tokenizes to no tokens")
    try:
        sampling.check_prompt(num_prompt_tokens)
    except InvalidArgument as err:
        raise InvalidArgument.many(
            [FieldViolation(f"sampling.{v.field}", v.description) for v in err.violations]
        ) from None
    if max_prompt_tokens is not None and num_prompt_tokens > max_prompt_tokens:
        raise InvalidArgument(
            prompt_field,
            count_of(num_prompt_tokens, "token"),
            f"too long: prefill accepts at most {max_prompt_tokens} prompt tokens; this "
            f"model's maximum context length is {max_context_tokens} tokens",
        )
    room = max_context_tokens - num_prompt_tokens
    if room < 1:
        raise InvalidArgument(
            prompt_field,
            count_of(num_prompt_tokens, "token"),
            f"too long: this model's maximum context length is {max_context_tokens} tokens, "
            "and the prompt must leave room for at least one generated token",
        )
    if sampling.max_tokens <= room:
        return sampling
    if sampling.min_tokens > room:
        raise InvalidArgument(
            "sampling.min_tokens",
            sampling.min_tokens,
            f"this model's maximum context length is {max_context_tokens} tokens: prompt "
            f"({plural(num_prompt_tokens, 'token')}) + min_tokens ({sampling.min_tokens}) is "
            f"over it; at most {room} fits",
        )
    if may_shrink:
        return replace(sampling, max_tokens=room)
    raise InvalidArgument(
        "sampling.max_tokens",
        sampling.max_tokens,
        f"this model's maximum context length is {max_context_tokens} tokens: prompt "
        f"({plural(num_prompt_tokens, 'token')}) + max_tokens ({sampling.max_tokens}) is over "
        f"it; at most {room} fits",
    )


def sampling_defaults(
    config: FrontendConfig, facts: TokenizerFacts | None
) -> tuple[tuple[str, float | int], ...]:
    """The (field, value) defaults requests' unset sampling fields take: the model's
    (generation_config.json, as vLLM and SGLang apply them; Qwen3's are the settings its model
    card recommends, and it warns that greedy decoding can repeat endlessly), unless turned off."""
    if facts is None or not config.model_sampling_defaults:
        return ()
    return facts.sampling_defaults


def with_defaults(
    sampling: SamplingParams, unset: frozenset[str], defaults: Sequence[tuple[str, float | int]]
) -> SamplingParams:
    """`defaults` (sampling_defaults) for the fields the caller left `unset`."""
    given: dict[str, Any] = {f: v for f, v in defaults if f in unset}
    return replace(sampling, **given) if given else sampling


def with_eos(sampling: SamplingParams, eos_token_ids: Sequence[int]) -> SamplingParams:
    """Add the model's EOS ids to the stop ids (unless ignore_eos), so decode stops on exactly
    the tokenizer's list (generation_config.json), whatever its own config says."""
    if sampling.ignore_eos:
        return sampling
    merged = tuple(dict.fromkeys([*sampling.stop_token_ids, *eos_token_ids]))
    return replace(sampling, stop_token_ids=merged)
