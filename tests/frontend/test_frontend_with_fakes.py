"""The frontend over real gRPC against scripted fake services: what it sends downstream, and
how it handles full, failing and mismatched instances (see fakes.py for the fakes' rules)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from mili import errors
from mili.pb.common.v1 import chat_pb2, sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from mili.rpc.status import retry_info_of
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.calls import Deadline, Tokenized
from services.frontend.generations import Generations
from services.frontend.http_api import choices as choices_of
from services.frontend.http_api.body import parse
from services.frontend.http_api.openai_request import completion_request
from services.frontend.validation import Limits
from tests.frontend import raw_grpc
from tests.frontend.fakes import (
    EOS,
    FakeDecode,
    FakePrefill,
    FakeTokenizer,
    Stack,
    code_of,
    collect,
    ids,
    layout,
    stack,
    wait_until,
)

OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def prompt(text: str = "hi", **sampling: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=text, sampling=sampling_pb2.SamplingParams(**sampling)
    )


def test_streams_text_and_sends_fully_resolved_sampling_downstream() -> None:
    async def main() -> None:
        async with stack() as s:
            responses = await collect(s.stub.Generate(prompt("hi", top_k=5), timeout=5))
            assert [list(r.token_ids) for r in responses] == [ids("ab"), ids("c")]
            assert "".join(r.text for r in responses) == "abc"
            last = responses[-1]
            assert last.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 3)
            assert len({r.request_id for r in responses}) == 1
            urgent = generation_pb2.GenerateRequest(prompt="hi", priority=-2)
            await collect(s.stub.Generate(urgent, timeout=5))
            assert s.decodes[0].requests[1].priority == -2  # decode preempts by it

            decoded = s.decodes[0].requests[0]
            prefilled = s.prefill.requests[0]
            for sent in (decoded.sampling, prefilled.sampling):
                assert all(sent.HasField(f) for f in OPTIONAL_SAMPLING)
                assert sent.max_tokens == 16 and sent.top_k == 5 and sent.top_p == 1.0
                assert list(sent.stop_token_ids) == [EOS]  # the tokenizer's EOS ids
            assert decoded.sampling == prefilled.sampling  # same seed on both sides
            # Prefill and decode key on the frontend's own id; the caller's is a label.
            assert decoded.request_id == prefilled.request_id != last.request_id
            assert decoded.client_request_id == prefilled.client_request_id == last.request_id
            assert prefilled.destination.transfer_token == "token-of-fake-decode"
            assert list(decoded.prompt_token_ids) == list(prefilled.prompt_token_ids) == ids("hi")
            assert decoded.prefill_layout == layout()
            assert decoded.priority == 0
            assert list(prefilled.destination.prompt_block_ids) == [1, 2]
            assert prefilled.destination.address in s.servers

    asyncio.run(main())


def test_complete_gathers_the_stream() -> None:
    async def main() -> None:
        async with stack() as s:
            reply = await s.stub.Complete(
                generation_pb2.CompleteRequest(request_id="r1", prompt="hi"), timeout=5
            )
            assert (reply.request_id, reply.text) == ("r1", "abc")
            assert list(reply.token_ids) == ids("abc")
            assert reply.usage.completion_tokens == 3

    asyncio.run(main())


def test_stop_string_across_events_cuts_text_and_cancels_decode() -> None:
    async def main() -> None:
        decode = FakeDecode(script=[ids("he"), ids("ll"), ids("o wor"), ids("ld"), ids("!!")])
        async with stack([decode]) as s:
            request = prompt("x")
            request.sampling.stop.append("lo w")
            responses = await collect(s.stub.Generate(request, timeout=5))
            assert "".join(r.text for r in responses) == "hel"
            assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
            assert responses[-1].usage.completion_tokens == 7  # up to "w", which completed it
            await wait_until(lambda: decode.num_closed == 1)  # decode stopped, not drained

    asyncio.run(main())


def test_max_tokens_and_eos_enforced_even_if_decode_overruns() -> None:
    async def main() -> None:
        decode = FakeDecode(script=[ids("abc"), ids("def"), ids("ghi")])
        async with stack([decode]) as s:
            responses = await collect(s.stub.Generate(prompt(max_tokens=4), timeout=5))
            assert [t for r in responses for t in r.token_ids] == ids("abcd")
            assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            decode.script = [ids("ab"), [*ids("c"), EOS, *ids("d")]]
            responses = await collect(s.stub.Generate(prompt(max_tokens=10), timeout=5))
            assert [t for r in responses for t in r.token_ids] == [*ids("abc"), EOS]
            assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
            assert "".join(r.text for r in responses) == "abc"

    asyncio.run(main())


def test_full_decode_is_skipped_for_the_next_one() -> None:
    async def main() -> None:
        full, free = FakeDecode(full=True), FakeDecode()
        async with stack([full, free]) as s:
            for _ in range(3):
                responses = await collect(s.stub.Generate(prompt(), timeout=5))
                assert responses[-1].usage.completion_tokens == 3
            assert len(free.requests) == 3
            assert 1 <= len(full.requests) <= 3  # tried when it looked emptier

    asyncio.run(main())


def test_every_decode_full_without_a_queue_is_resource_exhausted_with_retry_info() -> None:
    async def main() -> None:
        decodes = [FakeDecode(full=True), FakeDecode(full=True)]
        async with stack(decodes, max_queued_requests=0) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "every decode instance is full" in info.value.details()
            assert "admission queue is full" in info.value.details()
            retry = retry_info_of(info.value)
            assert retry is not None and retry.retry_delay.ToNanoseconds() == 250_000_000
            assert all(len(d.requests) == 1 for d in s.decodes)

    asyncio.run(main())


def test_prefill_failure_fails_the_request_at_once_and_releases_decode() -> None:
    async def main() -> None:
        prefill = FakePrefill(error=errors.Unavailable("fake prefill crashed"))
        async with stack(prefill=prefill) as s:
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=10))
            assert time.monotonic() - began < 2  # decode's KV lease is not waited out
            assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
            assert "prefill at" in info.value.details()
            assert "fake prefill crashed" in info.value.details()
            await wait_until(lambda: s.decodes[0].num_closed == 1)

    asyncio.run(main())


def test_a_prefill_down_before_the_first_token_hands_the_request_to_another() -> None:
    """A rolling restart: prefill A drains (its server refuses new calls UNAVAILABLE) before
    the next poll says so; the requests decode admitted meanwhile go to prefill B instead of
    failing. With no other prefill up, the error is the answer (the test above)."""

    async def main() -> None:
        draining = FakePrefill(error=errors.Unavailable("draining; retry on another instance"))
        spare = FakePrefill()
        async with stack(prefill=draining, spare_prefills=[spare], poll_interval_s=5.0) as s:
            for _ in range(3):
                replies = await collect(s.stub.Generate(prompt(), timeout=10))
                assert replies[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert spare.requests and draining.requests
            await wait_until(lambda: all(d.num_reserved == 0 for d in s.decodes))

    asyncio.run(main())


@pytest.mark.parametrize("seen_first_by", ["decode", "prefill"])
def test_a_decode_down_before_the_first_token_hands_the_request_to_another(
    seen_first_by: str,
) -> None:
    """Decode fails a request it admitted before its first token (killed, or draining in a
    rolling restart): the request goes to another decode that is up instead of failing (found
    by a read-only review: only a down prefill was retried); once a token went out, decode's
    error is the answer (test_decode_failure_mid_stream_names_decode). Also when decode dies
    while prefill sends it the KV and prefill's answer (its KV destination went away,
    PEER_UNAVAILABLE) comes before decode's stream breaks (found by
    tests/e2e/test_fault_soak.py: the order of the two is a race)."""

    async def main() -> None:
        if seen_first_by == "decode":
            victim, prefill = FakeDecode(fail_after=0), None  # admits, then fails
        else:
            victim = FakeDecode()
            prefill = FakePrefill(lost=victim)
        spare = FakeDecode(num_free_blocks=50)  # the victim is tried first
        async with stack([victim, spare], prefill=prefill, poll_interval_s=5.0) as s:
            replies = await collect(s.stub.Generate(prompt(), timeout=10))
            assert replies[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert [t for r in replies for t in r.token_ids] == ids("abc")
            assert victim.requests and spare.requests
            await wait_until(lambda: all(d.num_reserved == 0 for d in s.decodes))

    asyncio.run(main())


def test_a_request_failing_after_a_retry_says_so_in_its_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both decodes fail before the first token: the request is retried on the second, then
    fails. Its failed line says it was retried and why, as a done line does (an operator's
    pass: a failure after retries looked like a first try)."""

    async def main() -> None:
        decodes = [FakeDecode(fail_after=0), FakeDecode(fail_after=0)]
        async with stack(decodes, poll_interval_s=5.0) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=10))
            assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
            assert all(d.requests for d in decodes)

    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        asyncio.run(main())
    [line] = [r.getMessage() for r in caplog.records if " failed after " in r.getMessage()]
    said = r" failed after [\d.]+ ms \(retried \d times?: decode at \S+: UNAVAILABLE: fake "
    assert re.search(said + r"decode lost its device.*\): UNAVAILABLE: decode at ", line), line


def _record_marked_down(s: Stack) -> list[str]:
    """The addresses the frontend takes out of routing from now on (Router.mark_down)."""
    marked: list[str] = []
    router = s.backends.router
    mark_down = router.mark_down

    def record(address: str) -> None:
        marked.append(address)
        mark_down(address)

    router.mark_down = record  # type: ignore[method-assign]
    return marked


def test_a_full_prefill_is_resource_exhausted_and_takes_no_instance_down() -> None:
    """Issue 29: prefill refuses a prompt for room before any KV moves; with no admission
    queue to wait in (--max-queued-requests 0) the caller gets RESOURCE_EXHAUSTED, decode's
    reservation is released, and both instances stay routable with what the prefix index
    knows of them. (With a queue the request waits instead: test_queue_with_fakes.py.)"""

    async def main() -> None:
        full = errors.ResourceExhausted("prefill queue is full", retry_after_s=0.5)
        async with stack(prefill=FakePrefill(error=full), max_queued_requests=0) as s:
            decode_address = s.backends.config.decode_addresses[0]
            prefill_address = s.backends.config.prefill_addresses[0]
            router = s.backends.router
            held = router.prefix_index.keys(ids("x" * 40))  # what decode is known to hold
            router.prefix_index.record(decode_address, held, time.monotonic())
            marked = _record_marked_down(s)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "prefill queue is full" in info.value.details()
            retry = retry_info_of(info.value)
            assert retry is not None and retry.retry_delay.ToNanoseconds() == 500_000_000
            await wait_until(lambda: s.decodes[0].num_closed == 1)  # its blocks go back
            assert marked == []
            assert router.decodes[decode_address].is_up
            assert router.prefills[prefill_address].is_up
            assert router.prefix_index.matches(held, time.monotonic()) == {decode_address: 2}

    asyncio.run(main())


@pytest.mark.parametrize(
    "decode_error",
    [
        # prefill gave up on purpose (TransferAbort): decode fails the request with its status
        errors.ResourceExhausted("prefill gave up: queue full"),
        # prefill's stream broke off: decode blames it (ErrorInfo PEER_UNAVAILABLE)
        errors.PeerUnavailable("the KV transfer broke off", peer="p"),
    ],
    ids=["aborted", "broke-off"],
)
def test_decode_failing_for_its_prefill_is_not_taken_down(decode_error: Exception) -> None:
    """Decode reports a transfer its prefill ended before prefill's own error arrives: the
    request fails with prefill's answer (the cause; the frontend waits for it), and decode,
    which is fine, stays in routing."""

    async def main() -> None:
        prefill = FakePrefill(
            error=errors.ResourceExhausted("prefill queue is full"), decode_error=decode_error
        )
        async with stack(prefill=prefill) as s:
            marked = _record_marked_down(s)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "prefill at" in info.value.details(), info.value.details()
            await asyncio.sleep(0.15)  # prefill's own error arrives too
            assert marked == []
            assert all(member.is_up for member in s.backends.router.decodes.values())

    asyncio.run(main())


def test_decode_failure_mid_stream_names_decode() -> None:
    async def main() -> None:
        decode = FakeDecode(script=[ids("a"), ids("b"), ids("c")], fail_after=2)
        async with stack([decode]) as s:
            call = s.stub.Generate(prompt(), timeout=5)
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for response in call:
                    got.extend(response.token_ids)
            assert got == ids("ab")
            assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
            assert "decode at" in info.value.details() and "lost its device" in info.value.details()

    asyncio.run(main())


def test_layout_mismatch_is_failed_precondition_naming_both() -> None:
    async def main() -> None:
        async with stack([FakeDecode(kv_layout=layout(block_size=32))]) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.FAILED_PRECONDITION
            details = info.value.details()
            assert "block_size=16" in details and "block_size=32" in details
            assert "prefill at" in details and "decode at" in details
            assert s.decodes[0].requests == []  # refused before any reservation

    asyncio.run(main())


def test_layout_fixed_after_restart_is_rediscovered() -> None:
    async def main() -> None:
        decode = FakeDecode(kv_layout=layout(block_size=32))
        async with stack([decode]) as s:
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(s.stub.Generate(prompt(), timeout=5))
            decode.kv_layout = layout()  # as if restarted with the right block size
            await asyncio.sleep(0.2)  # a few polls
            responses = await collect(s.stub.Generate(prompt(), timeout=5))
            assert responses[-1].usage.completion_tokens == 3

    asyncio.run(main())


def test_decode_down_is_unavailable_naming_it() -> None:
    async def main() -> None:
        async with stack() as s:
            decode_address = next(iter(s.backends.config.decode_addresses))
            await s.servers.pop(decode_address).drain()
            await asyncio.sleep(0.2)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
            assert decode_address in info.value.details()
            info_reply = await s.stub.Info(generation_pb2.InfoRequest(), timeout=5)
            assert list(info_reply.decode_addresses) == [decode_address]

    asyncio.run(main())


class _FileLessTokenizer(FakeTokenizer):
    """Names a tokenizer file in Info but cannot hand it out."""

    async def GetTokenizerFile(self, request: object, context: object) -> object:
        raise errors.Unavailable("the file is gone")


def test_a_tokenizer_without_its_file_is_unavailable_naming_it() -> None:
    """The frontend detokenizes only with the tokenizer's file: without it, it serves nothing."""

    async def main() -> None:
        async with stack(tokenizer=_FileLessTokenizer()) as s:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
            assert "no usable tokenizer file" in info.value.details()
            assert s.backends.config.tokenizer_address in info.value.details()

    asyncio.run(main())


def test_info_reports_limits_and_instances() -> None:
    async def main() -> None:
        async with stack(limits=Limits()) as s:  # no default: the room the context leaves
            reply = await s.stub.Info(generation_pb2.InfoRequest(), timeout=5)
            assert (reply.default_max_tokens, reply.max_tokens_limit) == (0, 4096)
        async with stack(limits=Limits(default_max_tokens=16, max_tokens_limit=64)) as s:
            reply = await s.stub.Info(generation_pb2.InfoRequest(), timeout=5)
            assert (reply.model, reply.max_context_tokens) == ("fake", 4096)
            assert (reply.default_max_tokens, reply.max_tokens_limit) == (16, 64)
            assert len(reply.prefill_addresses) == len(reply.decode_addresses) == 1
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt(max_tokens=65), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())


def test_a_token_list_longer_than_the_context_is_refused_before_it_is_converted() -> None:
    """1.5 M ids (7.5 MB as 5-byte ids, under the public limit): refused from its count, in
    milliseconds, before a tuple of 1.5 M ints is made; nothing reaches the other services."""

    async def main() -> None:
        async with stack() as s:
            request = generation_pb2.GenerateRequest(token_ids=[5] * 1_500_000)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await collect(s.stub.Generate(request, timeout=10))
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "token_ids: more ids than the context window" in (caught.value.details() or "")
            assert time.monotonic() - started < 2
            assert s.decodes[0].requests == [] and s.prefill.requests == []

    asyncio.run(main())


class CountingTokenizer(FakeTokenizer):
    """Counts its Tokenize calls; `gate`, while unset, holds each call (so they overlap)."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.gate = asyncio.Event()

    async def Tokenize(self, request: object, context: object) -> object:
        self.num_calls += 1
        await self.gate.wait()
        return await super().Tokenize(request, context)


def test_the_choices_of_one_request_tokenize_their_prompt_once() -> None:
    """An HTTP request with n choices: n generations of one prompt under one deadline share
    one Tokenize call (n=128 was 128 calls at once); a gRPC caller's request, under a
    deadline of its own, still makes its own call."""

    async def main() -> None:
        tokenizer = CountingTokenizer()
        async with stack(tokenizer=tokenizer) as s:
            generations = Generations(s.backends, FrontendMetrics(CollectorRegistry()))
            body = parse(b'{"prompt": "hi", "n": 4, "max_tokens": 3}')
            request = completion_request(body, 4096, "rid")
            planned = choices_of.plan(generations, request)
            assert len(planned) == 4
            downstream = generations._downstream
            one, other = Deadline(None), Deadline(None)
            calls = [downstream.tokenize(c.valid, one) for c in planned]
            calls.append(downstream.tokenize(planned[0].valid, other))
            running = [asyncio.ensure_future(c) for c in calls]
            await wait_until(lambda: tokenizer.num_calls == 2)
            running[1].cancel()  # a choice that goes away leaves the call to the others
            tokenizer.gate.set()
            results = await asyncio.gather(*running, return_exceptions=True)
            assert isinstance(results[1], asyncio.CancelledError)
            assert [r for i, r in enumerate(results) if i != 1] == [Tokenized(tuple(ids("hi")))] * 4
            assert tokenizer.num_calls == 2

            # the whole request, as the HTTP API runs it: one call for its four choices
            tokenizer.num_calls = 0
            async for _ in choices_of.run(generations, planned, is_stream=False):
                pass
            assert tokenizer.num_calls == 1

    asyncio.run(main())


class OpenThinkTokenizer(FakeTokenizer):
    """Renders a chat's generation prompt as Qwen3's Thinking-2507 templates do: the think
    block opened ("<|im_start|>assistant\n<think>\n")."""

    async def Tokenize(self, request: object, context: object) -> object:
        reply = await super().Tokenize(request, context)
        if request.messages:  # type: ignore[attr-defined]
            reply.prompt += "<|im_start|>assistant\n<think>\n"  # type: ignore[attr-defined]
        return reply


def test_a_prompt_that_opens_the_think_block_starts_the_output_in_reasoning() -> None:
    """The model writes the reasoning and "</think>" only: its reasoning went to `text`, glued
    to the answer. Streamed and whole agree; a prompt request (not split) is the text as is."""
    script = [ids("I think"), ids(".</thi"), ids("nk>Hel"), ids("lo")]

    async def main() -> None:
        async with stack([FakeDecode(script=script)], tokenizer=OpenThinkTokenizer()) as s:
            chat = generation_pb2.CompleteRequest(
                messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                sampling=sampling_pb2.SamplingParams(max_tokens=64),
            )
            reply = await s.stub.Complete(chat, timeout=5)
            assert (reply.reasoning_text, reply.text) == ("I think.", "Hello")
            streamed = generation_pb2.GenerateRequest(
                messages=chat.messages, sampling=chat.sampling
            )
            responses = await collect(s.stub.Generate(streamed, timeout=5))
            assert "".join(r.reasoning_text for r in responses) == "I think."
            assert "".join(r.text for r in responses) == "Hello"
            plain = await s.stub.Complete(
                generation_pb2.CompleteRequest(prompt="hi", sampling=chat.sampling), timeout=5
            )
            assert (plain.reasoning_text, plain.text) == ("", "I think.</think>Hello")

    asyncio.run(main())


def test_only_the_first_choice_of_a_prompt_computes_its_prompt_logprobs() -> None:
    """n choices of a prompt with prompt_logprobs (or echo with logprobs) each recomputed the
    whole prompt's logprobs (prefill's cache unused for them); every choice shows the first
    choice's, so only it asks, streamed too (the others' echo waits for its first delta)."""

    async def main() -> None:
        async with stack() as s:
            generations = Generations(s.backends, FrontendMetrics(CollectorRegistry()))

            def asked(raw: bytes) -> list[int | None]:
                request = completion_request(parse(raw), 4096, "r")
                return [
                    c.valid.sampling.prompt_logprobs for c in choices_of.plan(generations, request)
                ]

            two_prompts = b'{"prompt": ["a", "b"], "n": 2, "prompt_logprobs": 3}'
            assert asked(two_prompts) == [3, None, 3, None]
            echoed = b'{"prompt": "a", "n": 3, "echo": true, "logprobs": 1}'
            assert asked(echoed) == [1, None, None]
            streamed = b'{"prompt": "a", "n": 3, "echo": true, "logprobs": 1, "stream": true}'
            assert asked(streamed) == [1, None, None]

    asyncio.run(main())


def test_the_later_choices_of_a_request_wait_past_the_queues_bound() -> None:
    """Three choices, decode room for one at a time, a queue of one: the third was turned away
    (429), failing the two already taken, and every retry met the same bound. Now the later
    choices wait past it; more choices than the frontend ever runs at once is a 400 naming n."""

    async def main() -> None:
        decode = FakeDecode(max_running=1)
        async with stack([decode], max_queued_requests=1) as s:
            generations = Generations(s.backends, FrontendMetrics(CollectorRegistry()))
            body = parse(b'{"prompt": "hi", "n": 3, "max_tokens": 3}')
            planned = choices_of.plan(generations, completion_request(body, 4096, "r"))
            assert [c.valid.is_later_choice for c in planned] == [False, True, True]
            finished = set()
            async for index, delta in choices_of.run(generations, planned, is_stream=False):
                if delta.finish_reason is not None:
                    finished.add(index)
            assert finished == {0, 1, 2}
            assert len(decode.admitted) == 3
            too_many = parse(b'{"prompt": "hi", "n": 5}')
            limited = dataclasses.replace(s.backends.config, max_concurrent_requests=4)
            generations.config = limited
            with pytest.raises(errors.InvalidArgument, match="more than this frontend runs") as n:
                choices_of.plan(generations, completion_request(too_many, 4096, "r"))
            assert n.value.violations[0].field == "n"
            prompts = parse(b'{"prompt": ["a", "b", "c", "d", "e"]}')  # n left out: not n's
            with pytest.raises(errors.InvalidArgument, match="more than this frontend runs") as p:
                choices_of.plan(generations, completion_request(prompts, 4096, "r"))
            assert p.value.violations[0].field == "prompt"

    asyncio.run(main())


def test_a_request_past_the_frontends_limit_is_refused_with_its_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--max-concurrent-requests 1: while one request runs a second is RESOURCE_EXHAUSTED with
    a retry hint, and it has its log line as every other failure does (an operator's pass: a
    429 at this limit was counted only); the first finishes, and the next one runs."""

    async def main() -> None:
        hold = asyncio.Event()
        async with stack([FakeDecode(hold=hold, hold_after=1)]) as s:
            generations = Generations(s.backends, FrontendMetrics(CollectorRegistry()))
            generations.config = dataclasses.replace(s.backends.config, max_concurrent_requests=1)
            body = parse(b'{"prompt": "hi", "max_tokens": 3}')
            [choice] = choices_of.plan(generations, completion_request(body, 4096, "first"))
            running = generations.run(choice.valid, Deadline(10))
            assert (await anext(running)).token_ids  # decode holds after its first event
            [refused] = choices_of.plan(generations, completion_request(body, 4096, "second"))
            with pytest.raises(errors.ResourceExhausted, match=r"its limit of 1 request$") as info:
                await anext(generations.run(refused.valid, Deadline(10)))
            assert info.value.retry_after_s is not None
            hold.set()
            async for _ in running:
                pass
            async for _ in generations.run(refused.valid, Deadline(10)):
                pass

    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "mili.frontend"]
    [refused] = [line for line in lines if line.startswith("'second'") and " failed " in line]
    assert re.search(
        r" failed after [\d.]+ ms: RESOURCE_EXHAUSTED: the frontend is running its limit of 1 "
        r"request\b",
        refused,
    ), refused
    assert [line for line in lines if line.startswith("'second'") and " done: " in line]


def test_a_default_max_tokens_is_fitted_to_the_decode_pool_too() -> None:
    """The fake decode holds 100 blocks of 16 (1,600 positions) in a 4,096-token context: a
    default of 4,000 fitted the context only, and a real pool then refused the request naming a
    max_tokens its caller never sent. An explicit one is not shrunk: it is refused, naming
    max_tokens (the caller's to fix), before any decode is asked."""

    async def main() -> None:
        async with stack(limits=Limits(default_max_tokens=4000)) as s:
            await collect(s.stub.Generate(prompt("hi"), timeout=5))
            assert s.decodes[0].requests[-1].sampling.max_tokens == 1600 - 2 + 1
            asked = len(s.decodes[0].requests)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt("hi", max_tokens=4000), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.max_tokens" in (info.value.details() or "")
            assert len(s.decodes[0].requests) == asked

    asyncio.run(main())


@pytest.mark.parametrize("grpc_timeout", ["2562047H", "9999999H"])
def test_a_deadline_centuries_away_reaches_every_service_as_one_grpc_can_carry(
    grpc_timeout: str,
) -> None:
    """grpc turns a timeout of billions of seconds into an expired deadline: the frontend once
    handed its caller's time_remaining() on as it was, and Complete failed at once with the
    tokenizer's DEADLINE_EXCEEDED (as UNAVAILABLE)."""

    async def main() -> None:
        async with stack() as s:
            request = generation_pb2.CompleteRequest(request_id="r1", prompt="hi")
            reply = await raw_grpc.unary(
                s.frontend.address,
                "/mili.frontend.v1.GenerationService/Complete",
                request.SerializeToString(),
                {"grpc-timeout": grpc_timeout},
            )
            assert reply is not None, "the call ended without a reply"
            complete = generation_pb2.CompleteResponse.FromString(reply)
            assert (complete.text, complete.usage.completion_tokens) == ("abc", 3)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("tokenizer", "enable_thinking", "is_chat", "think_block"),
    [
        (FakeTokenizer, None, True, sampling_pb2.THINK_BLOCK_OPTIONAL),  # Qwen3's hybrid template
        (OpenThinkTokenizer, None, True, sampling_pb2.THINK_BLOCK_OPEN),  # Thinking-2507's
        (FakeTokenizer, False, True, sampling_pb2.THINK_BLOCK_UNSPECIFIED),  # thinking off
        (OpenThinkTokenizer, None, False, sampling_pb2.THINK_BLOCK_UNSPECIFIED),  # a prompt
    ],
)
def test_a_chats_constraint_goes_after_the_think_block_its_prompt_leaves(
    tokenizer: type[FakeTokenizer], enable_thinking: bool | None, is_chat: bool, think_block: int
) -> None:
    """Prefill and decode are told where the constraint starts: after a think block the model
    may open (thinking on), inside one the prompt opened, or at the first token. It was always
    the first token: Qwen3 was made to write "{" where it writes <think>."""

    async def main() -> None:
        async with stack(tokenizer=tokenizer()) as s:
            sampling = sampling_pb2.SamplingParams(max_tokens=8, json_object=True)
            if is_chat:
                request = generation_pb2.CompleteRequest(
                    messages=[chat_pb2.ChatMessage(role="user", content="hi")], sampling=sampling
                )
                if enable_thinking is not None:
                    request.enable_thinking = enable_thinking
            else:
                request = generation_pb2.CompleteRequest(prompt="hi", sampling=sampling)
            await s.stub.Complete(request, timeout=5)
            for sent in (s.prefill.requests[0].sampling, s.decodes[0].requests[0].sampling):
                assert sent.json_object and sent.think_block == think_block

    asyncio.run(main())


def test_a_decode_whose_pool_could_never_hold_the_request_whole_is_never_asked() -> None:
    """Decode admits a request's first outputs and grows its blocks as it runs, so the routing
    rule (blocks at admission) fits a decode whose whole pool is smaller than the request at
    its longest; that one, first by its free blocks, would refuse it (INVALID_ARGUMENT). The
    request goes to the one that can hold it; one no decode can hold is a 400 at once."""

    async def main() -> None:
        small = FakeDecode(num_total_blocks=20, num_free_blocks=20)
        large = FakeDecode(num_total_blocks=100, num_free_blocks=15)
        async with stack(decodes=[small, large]) as s:
            # 2 prompt tokens + 400: 18 blocks at admission, 26 at its longest
            await collect(s.stub.Generate(prompt("hi", max_tokens=400), timeout=5))
            assert (small.admitted, large.admitted) == ([], ["hi"])
            await collect(s.stub.Generate(prompt("hi", max_tokens=4), timeout=5))
            assert small.admitted == ["hi"]  # a small one still goes to the freer pool
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(s.stub.Generate(prompt("hi", max_tokens=1700), timeout=5))
            assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
            assert "more than any decode instance has in all (at most 100)" in (
                info.value.details() or ""
            )

    asyncio.run(main())
