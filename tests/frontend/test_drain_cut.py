"""Requests a drain cuts (its timeout ran out) end UNAVAILABLE / 503 saying so, on both APIs,
and their log lines blame the drain, not the caller.

A real frontend (gRPC servicer and the HTTP app on one Generations, the HTTP port drained with
the gRPC server as serve-frontend wires it) over the fakes (fakes.py), whose decode holds each
request until told: the frontend's drain timeout is 0.5 s. Before the cut, grpc's own stop
ended a call CANCELLED or UNAVAILABLE with nothing said, an HTTP stream lost its last chunk
(an incomplete chunked body), and the request log said "the caller cancelled".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import grpc
import pytest

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from services.frontend.http_api.app import make_app
from services.frontend.http_api.server import HttpConfig, HttpServer
from tests.frontend.fakes import FakeDecode, Stack, ids, stack, wait_until

CUT = "frontend stopped before this call finished: its drain timeout (0.5 s) ran out"


@asynccontextmanager
async def serving(
    decode: FakeDecode, drain_timeout_s: float = 0.5
) -> AsyncIterator[tuple[Stack, HttpServer]]:
    async with stack([decode]) as s:
        config = HttpConfig(port=0, drain_timeout_s=drain_timeout_s)
        http = HttpServer(make_app(s.generations, config), config)
        await http.start()
        s.frontend.add_drain_hook(http.drain)
        try:
            yield s, http
        finally:
            await http.drain()


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mili.frontend"]


def test_a_grpc_call_the_drain_cuts_is_unavailable_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        decode = FakeDecode(hold=asyncio.Event(), hold_after=1, script=[ids("ab"), ids("c")])
        async with serving(decode) as (s, _):
            request = generation_pb2.GenerateRequest(
                prompt="held", sampling=sampling_pb2.SamplingParams(max_tokens=8)
            )
            call = s.stub.Generate(request, timeout=30)
            first = await call.read()
            assert first.text == "ab"  # streaming, then held at decode
            await s.frontend.drain()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == CUT
            await wait_until(lambda: decode.num_closed == 1)  # decode's side ended too

    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        asyncio.run(main())
    assert any("UNAVAILABLE after" in m and CUT in m for m in _request_lines(caplog))
    assert not any("the caller cancelled" in m for m in _request_lines(caplog))


def test_an_http_stream_the_drain_cuts_ends_with_an_error_event_then_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        decode = FakeDecode(hold=asyncio.Event(), hold_after=1, script=[ids("ab"), ids("c")])
        async with serving(decode) as (s, http), aiohttp.ClientSession() as session:
            url = http.url
            body = {"model": "fake", "prompt": "held", "max_tokens": 8, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200
                first = await response.content.readline()
                assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "ab"
                drain = asyncio.create_task(s.frontend.drain())
                rest = (await response.content.read()).decode()  # the body is complete
                await drain
            events = [e.strip().removeprefix("data: ") for e in rest.split("\n\n") if e.strip()]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["message"] == CUT
            await wait_until(lambda: decode.num_closed == 1)

    with caplog.at_level(logging.INFO, logger="mili.frontend"):
        asyncio.run(main())
    assert any("UNAVAILABLE after" in m and "drain timeout" in m for m in _request_lines(caplog))


def test_an_http_request_cut_before_its_answer_is_a_503_saying_why() -> None:
    async def main() -> None:
        decode = FakeDecode(hold=asyncio.Event(), hold_after=0)
        async with serving(decode) as (s, http), aiohttp.ClientSession() as session:
            url = http.url
            body = {"model": "fake", "prompt": "held", "max_tokens": 8}
            post = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))
            await wait_until(lambda: decode.num_reserved == 1)
            await s.frontend.drain()
            response = await post
            assert response.status == 503
            assert (await response.json())["error"]["message"] == CUT

    asyncio.run(main())


def test_an_http_stream_a_second_signal_cuts_says_so() -> None:
    """A second signal cancels the drain hooks (RpcServer._await_hooks): the HTTP drain then
    cut nothing, and its requests died with the channels behind them, blamed on decode ('decode
    at ...: the frontend is closing'). Found by an exploratory test."""

    async def main() -> None:
        decode = FakeDecode(hold=asyncio.Event(), hold_after=1, script=[ids("ab"), ids("c")])
        async with serving(decode, drain_timeout_s=30) as (_, http):
            async with aiohttp.ClientSession() as session:
                body = {"model": "fake", "prompt": "held", "max_tokens": 8, "stream": True}
                async with session.post(f"{http.url}/v1/completions", json=body) as response:
                    await response.content.readline()  # the first token's event
                    drain = asyncio.create_task(http.drain())
                    await asyncio.sleep(0.2)
                    drain.cancel()  # as the second signal does
                    async with asyncio.timeout(10):  # it hung: nothing cut the request
                        rest = (await response.content.read()).decode()
                    with pytest.raises(asyncio.CancelledError):
                        await drain
            events = [e.strip().removeprefix("data: ") for e in rest.split("\n\n") if e.strip()]
            assert events[-1] == "[DONE]"
            message = json.loads(events[-2])["error"]["message"]
            assert (
                message
                == "frontend stopped before this call finished: a second signal cut its drain"
            )

    asyncio.run(main())


def test_a_responses_stream_the_drain_cuts_ends_with_openais_error_event() -> None:
    """/v1/responses ends a failed stream with OpenAI's event: the error object typed "error"
    and numbered after the events before it. The bare {"error"} that chat streams end with failed
    the Vercel AI SDK's check of the event ("Type validation failed"), hiding the message; the
    openai SDK raises it either way."""

    async def main() -> None:
        decode = FakeDecode(hold=asyncio.Event(), hold_after=1, script=[ids("ab"), ids("c")])
        async with serving(decode) as (s, http), aiohttp.ClientSession() as session:
            body = {"model": "fake", "input": "held", "max_output_tokens": 8, "stream": True}
            async with session.post(f"{http.url}/v1/responses", json=body) as response:
                assert response.status == 200
                head = b""
                while b"response.output_text.delta" not in head:  # streaming, then held
                    head += await response.content.readline()
                drain = asyncio.create_task(s.frontend.drain())
                rest = await response.content.read()
                await drain
            raw = (head + rest).decode()
            events = [e.strip().removeprefix("data: ") for e in raw.split("\n\n") if e.strip()]
            assert events[-1] == "[DONE]"
            *before, failed = [json.loads(e) for e in events[:-1]]
            assert failed["type"] == "error"
            assert failed["sequence_number"] == before[-1]["sequence_number"] + 1
            assert failed["error"]["message"] == CUT
            assert failed["error"]["type"] == "service_unavailable_error"

    asyncio.run(main())
