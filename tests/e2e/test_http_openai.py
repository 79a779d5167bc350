"""The OpenAI-compatible HTTP API end to end: the real `openai` SDK (and a raw HTTP client for
the SSE bytes) against a real tokenizer, prefill, decode and frontend on the demo model, in
float32 so that greedy text is exact and comparable with the gRPC API's."""

from __future__ import annotations

import http.client
import json
import re
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import tokenizers

from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.e2e.conftest import Deployment, deploy
from tests.service_process import ServiceProcess

pytestmark = pytest.mark.slow

MAX_CONCURRENT = 4  # the frontend's limit: a request of more choices is a 400 naming n
PROMPT = "The quick brown fox"
SERVED_NAMES = ("qwen3-demo", "Qwen/Qwen3-0.6B")  # --served-model-name: reported, then an alias
# Long enough to still run when the test looks (the demo model makes ~300 tokens/s on 2 cores)
LONG = 4000


@pytest.fixture(scope="module")
def deployment(demo_model_dir: Path, e2e_tokenizer: ServiceProcess) -> Iterator[Deployment]:
    d = deploy(
        demo_model_dir,
        e2e_tokenizer,
        engine_args=("--dtype", "float32"),
        frontend_args=(
            "--http-port",
            "0",
            "--max-concurrent-requests",
            str(MAX_CONCURRENT),
            "--served-model-name",
            ",".join(SERVED_NAMES),
        ),
    )
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(deployment: Deployment) -> openai.OpenAI:
    url = deployment.frontend.http_url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def grpc_complete(deployment: Deployment, **sampling: Any) -> generation_pb2.CompleteResponse:
    request = generation_pb2.CompleteRequest(
        prompt=PROMPT, sampling=sampling_pb2.SamplingParams(**sampling)
    )
    return deployment.stub().Complete(request, timeout=60)


def test_models_lists_the_served_model(
    deployment: Deployment, client: openai.OpenAI, demo_model_dir: Path
) -> None:
    """--served-model-name: every name listed, the first reported (gRPC Info, each response)
    and any of them taken as `model`; the model directory's own name is then another model."""
    info = deployment.stub().Info(generation_pb2.InfoRequest(), timeout=5)
    listed = client.models.list().data
    assert [m.id for m in listed] == list(SERVED_NAMES) and listed[0].object == "model"
    assert info.model == SERVED_NAMES[0]
    # vLLM's fields, which clients size requests by: the window as gRPC Info says it
    assert {(m.model_extra or {}).get("max_model_len") for m in listed} == {info.max_context_tokens}
    assert {(m.model_extra or {}).get("root") for m in listed} == {SERVED_NAMES[0]}
    for name in SERVED_NAMES:
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert reply.model == SERVED_NAMES[0]
        assert client.models.retrieve(name).id == name  # GET /v1/models/{name}, "/" and all
    # a hub id or a path ending in a served name: taken by requests, so found here too
    for named in (f"Org/{SERVED_NAMES[0]}", f"/models/{SERVED_NAMES[0]}/"):
        assert client.completions.create(model=named, prompt=PROMPT, max_tokens=1).model
        assert client.models.retrieve(named).id == named
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(demo_model_dir.resolve().name)
    with pytest.raises(openai.NotFoundError, match="--served-model-name"):
        client.completions.create(model=demo_model_dir.resolve().name, prompt=PROMPT, max_tokens=1)


def test_completion_plain_streamed_and_grpc_agree(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    args: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    plain = client.completions.create(**args)
    (choice,) = plain.choices
    grpc = grpc_complete(deployment, max_tokens=12, temperature=0)
    assert choice.text == grpc.text and choice.index == 0
    assert choice.finish_reason == ("length" if len(grpc.token_ids) == 12 else "stop")
    assert plain.object == "text_completion" and plain.id.startswith("cmpl-")
    assert plain.usage is not None
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (
        grpc.usage.prompt_tokens,
        grpc.usage.completion_tokens,
    )
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    # vLLM writes its choice's every field: prompt_logprobs null when not asked (never streamed)
    assert (choice.model_extra or {}).get("prompt_logprobs", "absent") is None

    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == choice.finish_reason
    assert all(c.usage is None for c in text_chunks) and len({c.id for c in chunks}) == 1
    assert all("prompt_logprobs" not in (c.choices[0].model_extra or {}) for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage == plain.usage


def test_chat_plain_and_streamed_agree(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": "Hi there"}], max_tokens=16, seed=1
    )
    args["temperature"] = 0
    plain = client.chat.completions.create(**args)
    (choice,) = plain.choices
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert "<think>" not in (choice.message.content or "")
    assert "</think>" not in (choice.message.content or "")
    assert (plain.model_extra or {}).get("prompt_logprobs", "absent") is None  # as vLLM's

    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    *deltas, usage_chunk = chunks
    streamed = "".join(c.choices[0].delta.content or "" for c in deltas)
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in deltas)
    assert streamed == choice.message.content and (thought or None) == reasoning
    assert deltas[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage == plain.usage


def test_continuous_usage_counts_the_tokens_streamed_so_far(
    client: openai.OpenAI, model: str
) -> None:
    """vLLM's stream_options.continuous_usage_stats, which guidellm always sends and aiperf
    --per-chunk-usage reads (the tokens of the chunk that ends TTFT): every chunk carries the
    usage so far; include_usage is on unless set false, as vLLM reads stream_options. Each
    token has one logprobs entry, so the count is checked chunk by chunk. It was ignored: no
    usage but the last chunk's, and none at all without include_usage."""
    options: Any = {"continuous_usage_stats": True}
    args: dict[str, Any] = dict(model=model, temperature=0, stream=True, stream_options=options)
    args["extra_body"] = {"ignore_eos": True}
    completion = list(client.completions.create(**args, prompt=PROMPT, max_tokens=12, logprobs=0))
    chat = list(
        client.chat.completions.create(
            **args, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, logprobs=True
        )
    )
    role, *chat_chunks = chat
    assert role.choices[0].delta.role == "assistant"
    assert role.usage is not None and role.usage.completion_tokens == 0
    for chunks, num_tokens in (
        (completion, lambda c: len(c.choices[0].logprobs.tokens)),
        (chat_chunks, lambda c: len(c.choices[0].logprobs.content or [])),
    ):
        *streamed, last = chunks
        assert last.choices == [] and last.usage is not None
        assert (last.usage.completion_tokens, last.usage.total_tokens) == (
            12,
            last.usage.prompt_tokens + 12,
        )
        so_far = 0
        for chunk in streamed:
            so_far += num_tokens(chunk)
            assert chunk.usage is not None
            assert chunk.usage.prompt_tokens == last.usage.prompt_tokens
            assert chunk.usage.completion_tokens == so_far
        assert so_far == 12
    assert role.usage.prompt_tokens == chat_chunks[-1].usage.prompt_tokens

    off: Any = {"include_usage": False, "continuous_usage_stats": True}
    args["stream_options"] = off
    quiet = list(client.completions.create(**args, prompt=PROMPT, max_tokens=3))
    assert quiet and all(c.usage is None and c.choices for c in quiet)


def test_usage_counts_the_prompt_tokens_found_in_prefills_cache(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field, vLLM's with
    --enable-prompt-tokens-details), which aiperf's prompt-cache metrics read: it was absent
    (aiperf warned so on every run) though prefill's prefix cache served the prompt. A prompt
    sent again finds its blocks there; gRPC's Usage.cached_prompt_tokens says the same."""
    prompt = "A prompt that only this test sends, long enough to fill a few blocks. " * 4
    args: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    streamed = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    request = generation_pb2.CompleteRequest(
        prompt=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=2, temperature=0)
    )
    grpc = deployment.stub().Complete(request, timeout=60).usage
    assert cached_of(first) == 0
    cached = cached_of(again)
    assert again.usage is not None and 0 < cached < again.usage.prompt_tokens
    assert cached_of(streamed[-1]) == cached == grpc.cached_prompt_tokens
    assert grpc.prompt_tokens == again.usage.prompt_tokens


def cached_of(reply: Any) -> int:
    """A reply's (or a usage chunk's) usage.prompt_tokens_details.cached_tokens."""
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int)
    return cached


def test_chat_with_thinking_off_greedy_equals_grpc(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    plain = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_completion_tokens=10,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    request = generation_pb2.CompleteRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="Hi")],
        enable_thinking=False,
        sampling=sampling_pb2.SamplingParams(max_tokens=10, temperature=0),
    )
    grpc = deployment.stub().Complete(request, timeout=60)
    message = plain.choices[0].message
    # One splitter for both APIs: the random demo model may write tags itself, and the
    # thinking and the answer come apart the same way on each.
    reasoning = getattr(message, "reasoning_content", None)
    assert (grpc.text, grpc.reasoning_text or None) == (message.content, reasoning)
    assert plain.usage is not None
    assert plain.usage.completion_tokens == grpc.usage.completion_tokens


def test_reasoning_effort_none_turns_thinking_off(client: openai.OpenAI, model: str) -> None:
    """OpenAI's reasoning_effort "none" (LiteLLM's one way to turn reasoning off, sent as it
    is to an OpenAI-compatible server) is enable_thinking false: the same prompt, with the empty
    think block the template writes then. Any other effort thinks (Qwen3 has no budget); a value
    OpenAI does not have, or "none" beside enable_thinking true, is a 400 naming it."""
    ask: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0
    )
    off = client.chat.completions.create(
        **ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    prompt_tokens = {}
    for effort in ("none", "low", None):
        extra = {} if effort is None else {"reasoning_effort": effort}
        usage = client.chat.completions.create(**ask, extra_body=extra).usage
        assert usage is not None
        prompt_tokens[effort or "unset"] = usage.prompt_tokens
    assert off.usage is not None
    assert prompt_tokens["none"] == off.usage.prompt_tokens
    assert prompt_tokens["low"] == prompt_tokens["unset"] != off.usage.prompt_tokens
    for extra in (
        {"reasoning_effort": "max"},
        {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**ask, extra_body=extra)
        assert bad.value.param == "reasoning_effort", extra


def test_streamed_logprobs_come_with_the_text_they_make(client: openai.OpenAI, model: str) -> None:
    """A token whose text is held back (a character's first bytes: the demo model draws many)
    sends its logprob with the chunk holding its text, never alone in a chunk without text,
    which LiteLLM drops, logprobs and all. Each token's logprob still comes once."""
    num_held = 0
    for seed in range(12):
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=6,
                temperature=1.0,
                seed=seed,
                logprobs=True,
                top_logprobs=1,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
        )
        num_entries = 0
        for chunk in chunks:
            if not chunk.choices or chunk.choices[0].logprobs is None:
                continue
            choice = chunk.choices[0]
            assert choice.delta.content or choice.finish_reason, chunk
            entries = choice.logprobs.content or []  # type: ignore[union-attr]
            num_entries += len(entries)
            num_held += len(entries) > 1
        usage = chunks[-1].usage
        assert usage is not None and num_entries == usage.completion_tokens, seed
    assert num_held, "no token's text was held back: nothing was tested"


def test_a_context_overflow_is_worded_as_vllm_words_it(client: openai.OpenAI, model: str) -> None:
    """A prompt, or prompt + max_tokens, over the context window is a 400 naming the parameter
    whose message says "this model's maximum context length is N tokens", as vLLM's and
    OpenAI's do: LiteLLM tells an overflow by those words alone (ContextWindowExceededError,
    its context_window_fallbacks, "prompt is too long" to Claude Code), else a plain 400."""
    window = client.models.list().data[0].model_extra["max_model_len"]  # type: ignore[index]
    hi = [{"role": "user", "content": "Hi"}]
    too_long = [{"role": "user", "content": "hello " * window}]
    for messages, max_tokens, param in ((too_long, 8, "messages"), (hi, window, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)  # type: ignore[arg-type]
        assert bad.value.param == param
        assert f"this model's maximum context length is {window} tokens" in bad.value.message


def test_completion_logprobs_equal_grpc(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    reply = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    grpc = grpc_complete(deployment, max_tokens=6, temperature=0, logprobs=2)
    assert logprobs.token_logprobs == pytest.approx([lp.chosen.logprob for lp in grpc.logprobs])
    assert len(logprobs.tokens) == len(grpc.token_ids)
    for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and max(top.values()) >= chosen - 1e-6
    offsets = logprobs.text_offset
    assert offsets is not None and offsets[0] == 0
    assert offsets == sorted(offsets)


def test_completion_logprobs_true_is_one_as_vllm_takes_it(
    client: openai.OpenAI, model: str
) -> None:
    """evalscope perf --logprobs sends the chat API's `"logprobs": true` to /v1/completions as
    well; vLLM reads it as 1. It was a 400 here, and evalscope stopped at its connection test."""
    args: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    one = client.completions.create(**args, logprobs=1).choices[0].logprobs
    assert one is not None and one.top_logprobs
    asked = {"logprobs": True}
    whole = client.completions.create(**args, extra_body=asked).choices
    streamed = client.completions.create(**args, stream=True, extra_body=asked)
    for choices in (whole, [c for chunk in streamed for c in chunk.choices]):
        pieces = [c.logprobs for c in choices if c.logprobs is not None]
        chosen = [lp for p in pieces for lp in p.token_logprobs or []]
        assert chosen == pytest.approx(one.token_logprobs)
        tops = [sorted(t) for p in pieces for t in p.top_logprobs or []]
        assert tops == [sorted(t) for t in one.top_logprobs]  # the tokens: 1 or 2 each
    none = client.completions.create(**args, extra_body={"logprobs": False})
    assert none.choices[0].logprobs is None


@pytest.mark.parametrize("is_stream", [False, True])
def test_echo_with_logprobs_gives_the_prompts_logprobs(
    deployment: Deployment, client: openai.OpenAI, model: str, is_stream: bool
) -> None:
    """lm-eval's local-completions: echo + logprobs, the prompt's tokens with the logprobs
    prefill computed (the first null), then the generated ones; gRPC's prompt_logprobs agree."""
    args: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=2, temperature=0)
    if is_stream:
        chunks = list(client.completions.create(**args, echo=True, logprobs=1, stream=True))
        pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in pieces for t in (p.tokens or [])]
        values = [v for p in pieces for v in (p.token_logprobs or [])]
        tops = [t for p in pieces for t in (p.top_logprobs or [])]
    else:
        reply = client.completions.create(**args, echo=True, logprobs=1)
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None
        tokens, values = logprobs.tokens or [], logprobs.token_logprobs or []
        tops = logprobs.top_logprobs or []
        assert reply.choices[0].text.startswith(PROMPT)
    grpc = grpc_complete(deployment, max_tokens=2, temperature=0, logprobs=1, prompt_logprobs=1)
    num_prompt = grpc.usage.prompt_tokens
    assert len(grpc.prompt_logprobs) == num_prompt - 1
    assert len(tokens) == len(values) == len(tops) == num_prompt + 2
    assert "".join(tokens[:num_prompt]) == PROMPT
    assert values[0] is None and tops[0] is None
    expected = [lp.chosen.logprob for lp in grpc.prompt_logprobs]
    assert values[1:num_prompt] == pytest.approx(expected, abs=2e-4)
    assert values[num_prompt:] == pytest.approx([lp.chosen.logprob for lp in grpc.logprobs])
    for top, value in zip(tops[1:], values[1:], strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) >= value - 1e-6


def test_streamed_choices_of_an_echo_share_one_computation_of_its_logprobs(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    """Streamed echo + logprobs with n: each choice asked prefill for the prompt's logprobs,
    computing every position of it again (prompt logprobs leave the prefix cache unused). Now
    the first choice alone asks, the others reuse the prompt's blocks an earlier request left
    in prefill's cache (their log lines say so), and every choice still opens with the prompt
    and its logprobs."""
    block_size = deployment.decode_info().kv_layout.block_size
    prompt = [10 + (7 * i) % 500 for i in range(3 * block_size + 5)]
    args: dict[str, Any] = dict(model=model, prompt=prompt, max_tokens=3, temperature=0)
    client.completions.create(**args)  # prefill caches the prompt's full blocks
    start = len(deployment.frontend.stderr_lines)
    chunks = client.completions.create(
        **args, n=3, echo=True, logprobs=1, stream=True, extra_headers={"X-Request-Id": "echo-n"}
    )
    firsts: dict[int, Any] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
    whole = client.completions.create(**args, echo=True, logprobs=1).choices[0].logprobs
    assert whole is not None and whole.tokens is not None and whole.token_logprobs is not None
    assert sorted(firsts) == [0, 1, 2]
    for first in firsts.values():
        logprobs = first.logprobs
        assert logprobs.tokens[: len(prompt)] == whole.tokens[: len(prompt)], first.index
        values = logprobs.token_logprobs[: len(prompt)]
        assert values[0] is None and len(values) == len(prompt), first.index
        assert values[1:] == pytest.approx(whole.token_logprobs[1 : len(prompt)], abs=2e-4)
    done = re.compile(r"'echo-n\.\d' .* done: .*prefix cached: (\d+) tokens? on prefill")
    lines = deployment.frontend.lines_matching(done, 3, start=start)
    cached = sorted(int(m.group(1)) for line in lines if (m := done.search(line)))
    assert cached == [0, 3 * block_size, 3 * block_size], lines


# Prompts whose text the demo tokenizer changes (NFC) or splits inside characters (its
# byte-level vocabulary has no CJK or emoji tokens: each is several byte tokens).
ECHO_PROMPTS = {
    "nfd": "cafe\u0301 de\u0301ja\u0300 vu, n\u0303o",
    "cjk": "日本語のテキスト",
    "emoji": "hi 😀 there 👍🏽!",
    "mixed": "e\u0301 日 😀 ok",
}


@pytest.mark.parametrize("is_stream", [False, True])
@pytest.mark.parametrize("name", list(ECHO_PROMPTS))
def test_echo_text_offsets_index_the_returned_text(
    client: openai.OpenAI, model: str, name: str, is_stream: bool
) -> None:
    """Found by an earlier session: with echo and logprobs, `text_offset` counted the prompt's
    tokens' own text, which the tokenizer had normalized ("e\u0301" -> "é", NFC), while the
    echoed text is the prompt as sent: from the first decomposed character on, every offset
    was short by one per composed character. Each token must read where its offset points in
    the returned text: its text from there, as the normalizer reads it (a composed token
    starts at its base character); a token that is part of a character (U+FFFD) its whole
    characters before that."""
    prompt = ECHO_PROMPTS[name]
    args: dict[str, Any] = dict(
        model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    if is_stream:
        chunks = list(client.completions.create(**args, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in pieces for t in (p.tokens or [])]
        offsets = [o for p in pieces for o in (p.text_offset or [])]
    else:
        reply = client.completions.create(**args)
        text, logprobs = reply.choices[0].text, reply.choices[0].logprobs
        assert logprobs is not None
        tokens, offsets = logprobs.tokens or [], logprobs.text_offset or []
    assert text.startswith(prompt)  # echoed as sent, not normalized
    assert len(offsets) == len(tokens) > 4 and offsets == sorted(offsets)
    assert offsets[0] >= 0 and offsets[-1] <= len(text)
    for token, offset in zip(tokens, offsets, strict=True):
        whole = token.split("\ufffd")[0]  # the characters the token has whole
        rest = text[offset:]
        reads = rest.startswith(whole) or unicodedata.normalize("NFC", rest).startswith(whole)
        assert reads, (token, offset, rest[:8], list(zip(tokens, offsets, strict=True)))
    if name == "nfd":  # the composed tokens start at their base characters, as sent
        assert [o for t, o in zip(tokens, offsets, strict=True) if t == "é"] == [3, 7]


@pytest.mark.parametrize("is_stream", [False, True])
def test_max_tokens_zero_with_echo_scores_the_prompt_alone(
    deployment: Deployment,
    client: openai.OpenAI,
    model: str,
    demo_model_dir: Path,
    is_stream: bool,
) -> None:
    """lm-eval's loglikelihood request (`echo`, `logprobs`, `max_tokens: 0`, a prompt of ids):
    the prompt's tokens and logprobs, nothing generated; without echo max_tokens 0 is a 400."""
    tokenizer = tokenizers.Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    ids = tokenizer.encode(PROMPT, add_special_tokens=False).ids
    args: dict[str, Any] = dict(
        model=model, prompt=[list(ids)], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    if is_stream:
        chunks = list(client.completions.create(**args, stream=True))
        texts = [c.choices[0].text for c in chunks if c.choices]
        pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        values = [v for p in pieces for v in (p.token_logprobs or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        text = "".join(texts)
    else:
        reply = client.completions.create(**args)
        assert reply.usage is not None and reply.usage.completion_tokens == 0
        assert reply.usage.prompt_tokens == len(ids)
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None
        assert len(logprobs.tokens) == len(ids)
        values, finish, text = (
            logprobs.token_logprobs or [],
            reply.choices[0].finish_reason,
            reply.choices[0].text,
        )
    grpc = grpc_complete(deployment, max_tokens=1, temperature=0, prompt_logprobs=1)
    assert text == PROMPT
    assert finish == "length"
    assert values[0] is None and len(values) == len(ids)
    expected = [lp.chosen.logprob for lp in grpc.prompt_logprobs]
    assert values[1:] == pytest.approx(expected, abs=2e-4)
    with pytest.raises(openai.BadRequestError, match="0 only with echo"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)


def test_chat_top_logprobs(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert reply.usage is not None and len(logprobs.content) == reply.usage.completion_tokens
    for item in logprobs.content:
        assert len(item.top_logprobs) == 3 and item.bytes is not None
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # greedy: the most likely
        assert item.token == bytes(item.bytes).decode("utf-8", "replace")


def test_n_choices_and_batches_each_run_as_their_own_request(
    client: openai.OpenAI, model: str
) -> None:
    args: dict[str, Any] = dict(model=model, max_tokens=8, temperature=1.0)
    both = client.completions.create(**args, prompt=PROMPT, n=2, seed=5)
    assert [c.index for c in both.choices] == [0, 1]
    # Choice i draws from seed + i: each is the single request with that seed.
    for choice, seed in zip(both.choices, (5, 6), strict=True):
        alone = client.completions.create(**args, prompt=PROMPT, seed=seed)
        assert choice.text == alone.choices[0].text
    alone_usage = alone.usage
    assert both.usage is not None and alone_usage is not None
    assert both.usage.prompt_tokens == alone_usage.prompt_tokens  # the prompt counted once

    batch = client.completions.create(**args, prompt=[PROMPT, "Another one"], seed=5)
    assert [c.index for c in batch.choices] == [0, 1]
    other = client.completions.create(**args, prompt="Another one", seed=5)
    assert batch.choices[0].text == both.choices[0].text
    assert batch.choices[1].text == other.choices[0].text


def test_stop_string_and_echo(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    text = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop and text.index(stop) > 0
    stopped = client.completions.create(**args, extra_body={"ignore_eos": True}, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    echoed = client.completions.create(**{**args, "max_tokens": 4}, echo=True)
    assert echoed.choices[0].text == PROMPT + text[: len(echoed.choices[0].text) - len(PROMPT)]
    ids = client.completions.create(**{**args, "max_tokens": 1, "prompt": [5, 6, 7]}, echo=True)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3 and ids.choices[0].text


def test_min_tokens_holds_back_stop_ids_and_stop_strings(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    """min_tokens (vLLM's extra): the stop ids are not drawn before it, by prefill (the first
    token) nor decode, and stop strings match only from its last token on; gRPC and HTTP
    alike."""
    greedy = grpc_complete(deployment, max_tokens=12, temperature=0, ignore_eos=True)
    first = greedy.token_ids[0]
    plain = grpc_complete(deployment, max_tokens=12, temperature=0, stop_token_ids=[first])
    assert list(plain.token_ids) == [first] and plain.text == ""  # at once; its text left out
    held = grpc_complete(
        deployment, max_tokens=12, temperature=0, stop_token_ids=[first], min_tokens=4
    )
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:3]
    assert held.token_ids[0] != first  # prefill's draw held it back too
    args: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    http = client.completions.create(
        **args, extra_body={"stop_token_ids": [first], "min_tokens": 4}
    )
    assert http.choices[0].text == held.text
    assert http.usage is not None and http.usage.completion_tokens == len(held.token_ids)

    # A stop string inside the first tokens' text: cut there without min_tokens, not with it.
    text = greedy.text
    stop = text[:2]
    cut = client.completions.create(**args, extra_body={"ignore_eos": True}, stop=[stop])
    assert cut.choices[0].text == "" and cut.choices[0].finish_reason == "stop"
    whole = client.completions.create(
        **args, extra_body={"ignore_eos": True, "min_tokens": 12}, stop=[stop]
    )
    assert whole.choices[0].text.startswith(stop)
    assert whole.usage is not None and whole.usage.completion_tokens >= 11

    for extra, why in (
        ({"min_tokens": 13}, "max_tokens"),
        ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "constraint"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(**args, extra_body=extra)
        assert bad.value.param == "min_tokens" and why in bad.value.message


def test_logit_bias_forces_and_bans_tokens(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    """logit_bias on every draw, prefill's first token included; gRPC and HTTP alike."""
    greedy = grpc_complete(deployment, max_tokens=6, temperature=0, ignore_eos=True)
    first = greedy.token_ids[0]
    forced = 100 if first != 100 else 101  # an id the tokenizer has
    boosted = grpc_complete(
        deployment, max_tokens=6, temperature=0, ignore_eos=True, logit_bias={forced: 100.0}
    )
    assert list(boosted.token_ids) == [forced] * 6
    banned = grpc_complete(
        deployment, max_tokens=6, temperature=0, ignore_eos=True, logit_bias={first: -100.0}
    )
    assert first not in banned.token_ids
    args: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    http = client.completions.create(
        **args, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True}
    )
    assert http.choices[0].text == boosted.text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(**args, logit_bias={str(10**6): 1})
    assert bad.value.param == "logit_bias" and "outside the vocabulary" in bad.value.message


def test_errors_name_the_parameter(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt=PROMPT, top_p=5)
    assert bad.value.param == "top_p" and "top_p" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
    assert bad.value.param == "messages[0].role"
    # Known only once the prompt is tokenized: still a 400 before any byte of a stream.
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=10**6, stream=True)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert missing.value.code == "model_not_found"
    # "" is the served model, as vLLM takes it
    assert client.completions.create(model="", prompt=PROMPT, max_tokens=1).model == model
    # ... and a path or hub id ending in its name, as load generators given vLLM's --model send
    for named in (f"/models/{model}", f"Qwen/{model}", f"/models/{model}/"):
        assert client.completions.create(model=named, prompt=PROMPT, max_tokens=1).model == model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"/models/{model}/other", prompt=PROMPT)


def test_every_optional_field_sent_as_null_is_unset(client: openai.OpenAI, model: str) -> None:
    """Clients built on pydantic models send every optional field, unset ones as JSON null (at
    the top and inside tools and messages): the answer is the one without them, as OpenAI's and
    vLLM's."""
    shared: dict[str, Any] = dict(
        frequency_penalty=None,
        logit_bias=None,
        n=None,
        presence_penalty=None,
        seed=None,
        stop=None,
        stream_options=None,
        top_p=None,
        user=None,
    )
    extras = dict.fromkeys(
        [
            *("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos"),
            *("min_tokens", "prompt_logprobs", "response_format", "guided_json"),
            "structured_outputs",
        ]
    )
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    nulls = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        best_of=None,
        echo=None,
        logprobs=None,
        suffix=None,
        **shared,
        extra_body=extras,
    )
    assert nulls.choices[0].text == plain.choices[0].text

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "call_1"},
    ]
    unset = dict.fromkeys(("name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"))
    with_nulls = [unset | turn for turn in turns]
    tool_nulls = dict.fromkeys(("description", "parameters", "strict"))
    args: dict[str, Any] = dict(model=model, max_tokens=8, temperature=0)
    plain_chat = client.chat.completions.create(
        messages=turns,  # type: ignore[arg-type]
        tools=[{"type": "function", "function": {"name": "f"}}],
        **args,
    )
    for is_stream in (False, True):
        reply = client.chat.completions.create(
            messages=with_nulls,
            tools=[{"type": "function", "function": {"name": "f", **tool_nulls}}],
            logprobs=None,
            top_logprobs=None,
            max_completion_tokens=None,
            response_format=None,
            tool_choice=None,
            parallel_tool_calls=None,
            stream=is_stream,
            **shared,
            **args,
            extra_body=extras | {"chat_template_kwargs": None},
        )
        if is_stream:
            content = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            content = reply.choices[0].message.content
        assert content == plain_chat.choices[0].message.content, is_stream


def test_more_choices_than_the_frontend_ever_runs_is_400_naming_n(
    client: openai.OpenAI, model: str
) -> None:
    """It was a 429 with Retry-After, on an idle server too: a retry meets the same bound."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=PROMPT, n=MAX_CONCURRENT + 1, max_tokens=4)
    assert refused.value.param == "n"
    assert f"--max-concurrent-requests {MAX_CONCURRENT}" in refused.value.message
    reply = client.completions.create(model=model, prompt=PROMPT, n=MAX_CONCURRENT, max_tokens=2)
    assert sorted(c.index for c in reply.choices) == list(range(MAX_CONCURRENT))


def test_closing_a_stream_frees_its_blocks(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    before = deployment.settled_free_blocks()
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    assert deployment.free_blocks() != before  # decode holds the request's blocks
    stream.close()
    deployment.wait_free_blocks(before)


def test_a_client_gone_mid_request_frees_its_blocks(deployment: Deployment) -> None:
    before = deployment.settled_free_blocks()
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    connection = http_connection(deployment)
    connection.request("POST", "/v1/completions", json.dumps(body))
    deadline = time.monotonic() + 20
    while deployment.free_blocks() == before:  # running
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    connection.close()
    deployment.wait_free_blocks(before)


def http_connection(deployment: Deployment) -> http.client.HTTPConnection:
    url = urlsplit(deployment.frontend.http_url)
    assert url.hostname is not None and url.port is not None
    return http.client.HTTPConnection(url.hostname, url.port, timeout=60)


def test_sse_framing_byte_for_byte(deployment: Deployment) -> None:
    connection = http_connection(deployment)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    connection.request(
        "POST", "/v1/completions", json.dumps(body), headers={"X-Request-Id": "sse-1"}
    )
    response = connection.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    assert response.getheader("X-Request-Id") == "sse-1"
    raw = response.read()
    connection.close()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], raw[-80:]
    chunks = []
    for event in events[:-2]:
        assert event.startswith(b"data: {") and b"\n" not in event, event
        chunk = json.loads(event.removeprefix(b"data: "))
        assert event == b"data: " + json.dumps(chunk).encode()  # one line, as json.dumps writes
        chunks.append(chunk)
    assert {c["id"] for c in chunks} == {"cmpl-sse-1"}
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks)  # without include_usage, as OpenAI
    assert raw == b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    "regex",
    [
        "((a{100}){100}){100}",  # past the grammar engine's limits at the first token (prefill)
        "[0-9]{5}((a{90}){90}){90}",  # ... at the sixth (decode)
    ],
)
def test_a_grammar_too_complex_past_its_compile_is_the_clients_error(
    client: openai.OpenAI, model: str, regex: str
) -> None:
    """Found by a review: a regex that compiles (its first mask is cheap) but runs the lexer
    past llguidance's limits some tokens in was a 500 "internal error" with ERROR tracebacks
    in three services; as at compile it is the client's: 400 limit_exceeded naming the
    constraint, and the server serves on."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model, prompt="hi", max_tokens=12, extra_body={"guided_regex": regex}
        )
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "limit_exceeded", error
    # (named as the downstream services know it: sampling.regex is guided_regex; the first now
    # past the compile's memory limit already, trial.py)
    assert error["message"].startswith("sampling.regex: "), error
    assert "too complex" in error["message"] or "MiB of memory" in error["message"], error
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decode_is_400(deployment: Deployment, encoding: str) -> None:
    """Found by a review: a corrupt gzip or deflate body was a 500 "internal error" with a
    traceback in the log; the client sent it, so it is the client's 400, and one WARNING line
    (aiohttp reads the rest of the body after the answer, and logged that as an ERROR)."""
    log = deployment.frontend
    start = len(log.stderr_lines)
    connection = http_connection(deployment)
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    connection.request("POST", "/v1/completions", b"xxxx", headers=headers)
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    connection.close()
    assert response.status == 400, error
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"the request body: Can not decode content-encoding: {encoding}"
    (line,) = log.lines_matching(re.compile("bad HTTP request"), 1, start=start)
    assert "WARNING" in line and encoding in line
    assert not [x for x in log.stderr_lines[start:] if "ERROR" in x or "Traceback" in x]


def test_an_oversized_body_is_413_and_leaves_nothing_behind(
    deployment: Deployment, client: openai.OpenAI, model: str
) -> None:
    """The body limit is the gRPC port's (8 MiB): a larger body is refused as it is read, with
    OpenAI's error, and the frontend neither keeps it nor stops serving."""
    body = json.dumps({"model": model, "prompt": "x" * (9 << 20)}).encode()
    pid = deployment.frontend.proc.pid
    before = _rss_bytes(pid)
    for _ in range(5):
        connection = http_connection(deployment)
        connection.request(
            "POST", "/v1/completions", body, headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        error = json.loads(response.read())["error"]
        connection.close()
        assert response.status == 413
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        assert str(8 << 20) in error["message"]
    assert _rss_bytes(pid) - before < 64 << 20  # five 9 MiB bodies are not all still held
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
