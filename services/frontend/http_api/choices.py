"""The choices of one OpenAI request, each a generation of its own, run at once.

    prompts (a completions batch, or the one chat) x n  ->  choice index = prompt * n + i

Each choice is validated as the gRPC API validates a request (Generations.validate: one rule),
draws from its own seed (the caller's + i, or a fresh one) and runs through Generations.run in
this process (no extra hop); only the first choice of each prompt computes the prompt's
logprobs, which all its choices show (streamed, the others' chunks wait for its first:
completions.py). Their deltas come out through one generator, tagged with the choice's index;
closing it (the client went away) closes every generation, so decode frees their blocks. An
error of any choice ends them all.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from mili.cut import cut_reason
from mili.errors import InvalidArgument
from services.frontend.calls import Deadline
from services.frontend.coalescer import coalesced
from services.frontend.generations import Generations
from services.frontend.http_api.openai_request import OpenAIRequest, nth_seed, with_seed
from services.frontend.pipeline import Delta
from services.frontend.validation import ValidRequest


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int  # which of the request's prompts it continues
    valid: ValidRequest


def plan(generations: Generations, request: OpenAIRequest) -> list[Choice]:
    """Every choice, validated; InvalidArgument in validation's field names (the request's
    `param_of` maps them), or naming `n` when the frontend could never run them all at once.
    The choices after the first wait for room past the admission queue's bounds: the request
    was taken with its first, and a later one turned away would fail those already running
    (retrying the whole request would meet the same bound)."""
    choices = []
    num_choices = len(request.inputs) * request.n
    most = generations.config.max_concurrent_requests
    if num_choices > most:
        raise InvalidArgument(
            "n" if request.n > 1 else "prompt",  # the field the client can lower
            request.n if request.n > 1 else f"{len(request.inputs)} prompts",
            f"{num_choices} choices ({len(request.inputs)} prompts x n) are more than this "
            f"frontend runs at once (--max-concurrent-requests {most})",
        )
    for p, prompt in enumerate(request.inputs):
        for i in range(request.n):
            index = p * request.n + i
            one = with_seed(prompt, nth_seed(prompt.sampling.seed, i))
            if i > 0 and one.sampling.prompt_logprobs is not None:
                # Every choice of a prompt shows its first choice's prompt logprobs: the
                # others skip computing them (each over the whole prompt, its cache unused).
                one = replace(one, sampling=replace(one.sampling, prompt_logprobs=None))
            valid = generations.validate(one)
            if num_choices > 1:  # one id per generation in logs and traces: the request's + .i
                valid = replace(
                    valid,
                    client_request_id=f"{valid.client_request_id}.{index}",
                    is_later_choice=index > 0,
                )
            choices.append(Choice(index, p, valid))
    return choices


def run(
    generations: Generations, choices: Sequence[Choice], *, is_stream: bool
) -> AsyncGenerator[tuple[int, Delta], None]:
    """(choice index, delta) as they come, from every choice at once. Streamed, a choice whose
    client lags gets its pending deltas merged into one (coalescer.py), as on gRPC."""
    deadline = Deadline(None)  # an HTTP request runs until it finishes or its client leaves
    config = generations.config
    streams = []
    for choice in choices:
        deltas = generations.run(choice.valid, deadline)
        if is_stream:
            deltas = coalesced(
                deltas,
                max_buffered_tokens=config.max_buffered_tokens,
                stream_interval=config.stream_interval,
            )
        streams.append(deltas)
    return fan_in(streams, [c.index for c in choices])


async def fan_in(
    streams: Sequence[AsyncGenerator[Delta, None]], indexes: Sequence[int]
) -> AsyncGenerator[tuple[int, Delta], None]:
    """Every stream's deltas tagged with its index, in the order they come; the first error
    raised (after what came before it). One stream is read directly, without a task."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield indexes[0], delta
        return
    # Bounded: a stream waits while the reader is behind (the coalescer sits before it).
    queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue(len(streams))
    is_closing = False

    async def pull(index: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async with aclosing(stream):
                async for delta in stream:
                    if is_closing:  # a cancellation the generation swallowed (coalescer.py)
                        return
                    await queue.put((index, delta))
        except Exception as exc:
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pull(i, s)) for i, s in zip(indexes, streams, strict=True)]
    cut: str | None = None
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    except asyncio.CancelledError as exc:
        cut = cut_reason(exc)  # a drain's cut goes on to the generations, for their log lines
        raise
    finally:
        is_closing = True
        for task in tasks:
            task.cancel(cut)
        await asyncio.gather(*tasks, return_exceptions=True)


class Usage:
    """OpenAI's usage: each prompt's tokens once (not once per choice), every choice's
    completion tokens; prompt_tokens_details.cached_tokens, the prompt tokens prefill took
    from its prefix cache (OpenAI's field; vLLM's with --enable-prompt-tokens-details), which
    aiperf's prompt-cache metrics read."""

    def __init__(self, choices: Sequence[Choice]) -> None:
        self._prompt_of = {c.index: c.prompt_index for c in choices}
        self._prompt_tokens: dict[int, int] = {}
        self._cached_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def add(self, index: int, last: Delta) -> None:
        """A choice's last delta (its usage)."""
        prompt = self._prompt_of[index]
        self._prompt_tokens[prompt] = last.num_prompt_tokens
        # Each choice runs its prompt on its own: counted as cached, what all of them found
        cached = self._cached_tokens.get(prompt, last.num_cached_tokens)
        self._cached_tokens[prompt] = min(cached, last.num_cached_tokens)
        self._completion_tokens += last.num_completion_tokens

    def as_json(self) -> dict[str, Any]:
        usage: dict[str, Any] = usage_json(
            sum(self._prompt_tokens.values()), self._completion_tokens
        )
        usage["prompt_tokens_details"] = {"cached_tokens": sum(self._cached_tokens.values())}
        return usage


def usage_json(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def chunk_tail(request: OpenAIRequest, delta: Delta | None) -> str:
    """What closes a stream chunk after its choices: `"usage": null` with include_usage (the
    usage comes in a chunk of its own at the end); with continuous_usage_stats, the usage so
    far of the choice whose `delta` the chunk carries, as vLLM gives it."""
    if request.is_continuous_usage and delta is not None:
        usage = usage_json(delta.num_prompt_tokens, delta.num_completion_tokens)
        return f'], "usage": {json.dumps(usage)}}}'
    return '], "usage": null}' if request.include_usage else "]}"
