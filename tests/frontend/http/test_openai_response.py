"""The OpenAI response shapes from deltas, without servers: chat's reasoning split over every
cut of the text, usage across prompts and choices, echo, and fan_in's order, errors and
closing."""

from __future__ import annotations

import asyncio
import itertools
import json
import tracemalloc
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from mili.engine.logprobs import TokenLogprobs
from mili.engine.stop import FinishReason
from services.frontend.http_api.chat import ChatJson
from services.frontend.http_api.choices import Choice, fan_in
from services.frontend.http_api.completions import CompletionJson
from services.frontend.http_api.openai_call import Head
from services.frontend.http_api.openai_request import OpenAIRequest
from services.frontend.pipeline import Delta
from services.frontend.validation import Limits, RequestInput, SamplingInput, validate

HEAD = Head("r1", 1700000000, "m")
THOUGHT = "<think>\nplan: say hi\n</think>\n\nHello <b>there</b>"


def choices(num_prompts: int, n: int) -> list[Choice]:
    valid = validate(RequestInput(prompt="x"), Limits())
    return [Choice(p * n + i, p, valid) for p in range(num_prompts) for i in range(n)]


def request(**fields: Any) -> OpenAIRequest:
    return OpenAIRequest(model=None, inputs=(RequestInput(prompt="x"),), **fields)


def deltas_cut(text: str, cuts: list[int]) -> list[Delta]:
    """`text` as deltas cut at `cuts`, one token id each, the last finished."""
    bounds = [0, *cuts, len(text)]
    parts = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out = [Delta([i], part) for i, part in enumerate(parts)]
    out[-1].finish_reason = FinishReason.STOP
    out[-1].num_prompt_tokens, out[-1].num_completion_tokens = 4, len(parts)
    return out


def events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("is_thinking", [True, False])
def test_chat_never_streams_reasoning_or_tags_into_content(is_thinking: bool) -> None:
    text = THOUGHT if is_thinking else "Hello <b>there</b>"
    whole = ChatJson(request(), choices(1, 1), HEAD, None)
    (choice,) = json.loads(whole.whole({0: deltas_cut(text, [])}))["choices"]
    message = choice["message"]
    assert message["content"] == "Hello <b>there</b>"
    assert message["reasoning_content"] == ("plan: say hi" if is_thinking else None)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1, 3):
            chat = ChatJson(request(is_stream=True), choices(1, 1), HEAD, None)
            chunks = events(chat.opening())
            for delta in deltas_cut(text, [a, b]):
                chunks += events(chat.of(0, delta))
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            said = [c["choices"][0]["delta"] for c in chunks[1:]]
            content = "".join(d.get("content", "") for d in said)
            reasoning = "".join(d.get("reasoning_content", "") for d in said)
            assert content == message["content"], (a, b)
            assert (reasoning or None) == message["reasoning_content"], (a, b)
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chat_started_in_reasoning_splits_whole_and_streamed_alike() -> None:
    """The prompt opened the think block (the first delta says so): text up to "</think>" is
    reasoning, in the whole answer and in every cut of the stream."""
    text = "plan: say hi\n</think>\n\nHello"
    whole = ChatJson(request(), choices(1, 1), HEAD, None)
    ds = deltas_cut(text, [])
    ds[0].starts_in_reasoning = True
    (choice,) = json.loads(whole.whole({0: ds}))["choices"]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (
        "plan: say hi",
        "Hello",
    )
    for a in range(len(text) + 1):
        chat = ChatJson(request(is_stream=True), choices(1, 1), HEAD, None)
        chunks = events(chat.opening())
        ds = deltas_cut(text, [a])
        ds[0].starts_in_reasoning = True
        for delta in ds:
            chunks += events(chat.of(0, delta))
        said = [c["choices"][0]["delta"] for c in chunks[1:]]
        assert "".join(d.get("reasoning_content", "") for d in said) == "plan: say hi", a
        assert "".join(d.get("content", "") for d in said) == "Hello", a


def test_usage_counts_each_prompt_once_and_every_choice() -> None:
    completion = CompletionJson(request(), choices(2, 2), HEAD, ["A", "B"], None)
    deltas = {i: deltas_cut("ab", [1]) for i in range(4)}  # 4 prompt tokens, 2 generated each
    # Prompt A's choices found 3 and 2 of its tokens in prefill's cache, B's 1 and 0: what all
    # of a prompt's choices found counts, once per prompt
    for i, cached in enumerate([3, 2, 1, 0]):
        deltas[i][-1].num_cached_tokens = cached
    reply = json.loads(completion.whole(deltas))
    assert reply["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 8,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert [c["text"] for c in reply["choices"]] == ["Aab", "Aab", "Bab", "Bab"]  # echo
    assert reply["id"] == "cmpl-r1" and reply["object"] == "text_completion"


def test_completion_stream_echoes_once_and_closes_with_usage() -> None:
    completion = CompletionJson(
        request(is_stream=True, include_usage=True), choices(1, 1), HEAD, ["P"], None
    )
    chunks = [c for d in deltas_cut("abc", [1, 2]) for c in events(completion.of(0, d))]
    assert [c["choices"][0]["text"] for c in chunks] == ["Pa", "b", "c"]
    assert all(c["usage"] is None for c in chunks)
    (last,) = events(completion.closing())
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("is_stream", [False, True])
def test_prompt_only_hides_the_token_run_to_get_there(is_stream: bool) -> None:
    """echo with max_tokens 0: the prompt, no completion tokens, finish "length" even when the
    one token run for it (max_tokens 1 inside) stopped on an EOS or a stop string."""
    deltas = deltas_cut("z", [])  # one token that finished by STOP
    shown = request(is_prompt_only=True, echo=True, is_stream=is_stream, include_usage=is_stream)
    completion = CompletionJson(shown, choices(1, 1), HEAD, ["P"], None)
    if is_stream:
        chunks = [c for d in deltas for c in events(completion.of(0, d))]
        (last,) = events(completion.closing())
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish, usage = chunks[-1]["choices"][0]["finish_reason"], last["usage"]
    else:
        reply = json.loads(completion.whole({0: deltas}))
        (choice,) = reply["choices"]
        text, finish, usage = choice["text"], choice["finish_reason"], reply["usage"]
    assert (text, finish) == ("P", "length")
    assert usage == {
        "prompt_tokens": 4,
        "completion_tokens": 0,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def stream(name: str, n: int, closed: list[str], fail: bool = False) -> AsyncGenerator[Delta]:
    try:
        for i in range(n):
            await asyncio.sleep(0)
            yield Delta([i], f"{name}{i}")
        if fail:
            raise RuntimeError(f"{name} failed")
        await asyncio.sleep(3600)  # a generation still running
    finally:
        closed.append(name)


def test_fan_in_tags_each_delta_and_closing_closes_every_stream() -> None:
    async def main() -> None:
        closed: list[str] = []
        merged = fan_in([stream("a", 2, closed), stream("b", 2, closed)], [0, 1])
        seen = [await anext(merged) for _ in range(4)]
        assert sorted((i, d.text) for i, d in seen) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1")]
        await merged.aclose()
        assert sorted(closed) == ["a", "b"]

    asyncio.run(main())


def test_fan_in_raises_the_first_error_and_closes_the_rest() -> None:
    async def main() -> None:
        closed: list[str] = []
        merged = fan_in([stream("a", 1, closed), stream("b", 1, closed, fail=True)], [0, 1])
        texts = []
        with pytest.raises(RuntimeError, match="b failed"):
            async for _, delta in merged:
                texts.append(delta.text)
        assert sorted(texts) == ["a0", "b0"] and sorted(closed) == ["a", "b"]

    asyncio.run(main())


class DigitPieces:
    """TokenPieces' face for the formats: a token id's text is its digits."""

    def text(self, token_id: int) -> str:
        return str(token_id)

    def text_bytes(self, token_id: int, *, skip_special_tokens: bool) -> bytes:
        return str(token_id).encode()

    def normalize(self, text: str) -> str:
        return text


def test_the_n_choices_of_a_prompt_share_its_prompt_logprobs() -> None:
    """vLLM's prompt_logprobs k of one prompt were built anew at each of its n choices: a
    4,000-token prompt with k = 20 and n = 16 took mili serve's frontend (demo model) from 86 to
    657 MiB, about 33 MiB a choice (n may be 128). The JSON repeats them at every choice, as
    vLLM's does; the objects it is made from are one list a prompt."""
    num_tokens, k = 400, 5
    first = Delta(
        [7],
        "x",
        prompt_token_ids=list(range(num_tokens)),
        prompt_logprobs=[
            TokenLogprobs(-1.0 - t / 1e3, [(t + j, -0.5 - j) for j in range(k)], 3)
            for t in range(1, num_tokens)
        ],
    )

    def peak(n: int) -> tuple[int, dict[str, Any]]:
        completion = CompletionJson(
            request(n=n, prompt_logprobs=k),
            choices(1, n),
            HEAD,
            [],
            DigitPieces(),  # type: ignore[arg-type]
        )
        deltas = {i: [first if i == 0 else Delta([7], "x")] for i in range(n)}
        for ds in deltas.values():
            ds[-1].finish_reason = FinishReason.LENGTH
        tracemalloc.start()
        body = completion.whole(deltas)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return peak, json.loads(body)

    one, reply = peak(1)
    eight, replies = peak(8)
    (entries,) = [c["prompt_logprobs"] for c in reply["choices"]]
    assert entries[0] is None and len(entries) == num_tokens
    assert entries[1] == {"1": {"logprob": -1.001, "rank": 3, "decoded_token": "1"}} | {
        str(1 + j): {"logprob": -0.5 - j, "rank": j + 1, "decoded_token": str(1 + j)}
        for j in range(k)
    }
    assert all(c["prompt_logprobs"] == entries for c in replies["choices"])
    assert eight < 3.5 * one  # eight copies of the objects: 5x; one and eight strings: 2.5x


def test_streamed_choices_wait_for_the_first_ones_prompt_logprobs() -> None:
    """Streamed with echo and logprobs, a prompt's first choice alone computes the prompt's
    logprobs (choices.plan): another choice's deltas that come before its first are held, then
    each choice opens with the prompt and the first choice's logprobs for it."""
    sampling = SamplingInput(logprobs=1, prompt_logprobs=1)
    shared = OpenAIRequest(
        model=None,
        inputs=(RequestInput(prompt="12", sampling=sampling),),
        n=3,
        is_stream=True,
        echo=True,
    )
    completion = CompletionJson(shared, choices(1, 3), HEAD, ["12"], DigitPieces())  # type: ignore[arg-type]

    def generated(token_id: int) -> Delta:
        return Delta([token_id], str(token_id), [TokenLogprobs(-0.5, [(token_id, -0.5)])])

    assert completion.of(1, generated(4)) == []  # before the first choice's first delta
    assert completion.of(1, generated(5)) == []
    first = generated(3)
    first.prompt_token_ids = [1, 2]
    first.prompt_logprobs = [TokenLogprobs(-0.25, [(2, -0.25)], 1)]
    chunks = [c["choices"][0] for c in events(completion.of(0, first))]
    assert [(c["index"], c["text"]) for c in chunks] == [(0, "123"), (1, "124"), (1, "5")]
    for c, token in zip(chunks[:2], "34", strict=True):
        assert c["logprobs"]["tokens"] == ["1", "2", token]
        assert c["logprobs"]["token_logprobs"] == [None, -0.25, -0.5]
        assert c["logprobs"]["text_offset"] == [0, 1, 2]
    assert chunks[2]["logprobs"]["tokens"] == ["5"]
    # A choice whose first delta comes after the first choice's opens with the prompt too
    (late,) = [c["choices"][0] for c in events(completion.of(2, generated(6)))]
    assert (late["text"], late["logprobs"]["tokens"]) == ("126", ["1", "2", "6"])
