"""Scriptable fake tokenizer, prefill and decode services (no model), and a frontend in front of
them, all in one event loop on real gRPC servers: for the frontend's edge cases, in milliseconds.

Fake tokenizer: one token per printable ASCII character, id = ord(c) - 32 (vocab 100, EOS 99);
its tokenizer file (what the frontend detokenizes with) says the same.
Fake decode: admits with blocks [1, 2], waits for the fake prefill's "transfer" (an event), then
streams `script` (lists of token ids, one Tokens event each) and finishes with LENGTH, unless
`full` (RESOURCE_EXHAUSTED) or `fail_after` (UNAVAILABLE after that many events), or the fake
prefill failed the transfer (`transfer_error`, the error real decode reports then). With
`max_running` it holds that many reservations at most (more: RESOURCE_EXHAUSTED with RetryInfo,
as a real decode instance out of blocks or batch places); `hold`, when given, keeps every
admitted request from streaming until it is set; `is_stopped` makes its Info never answer (a
SIGSTOPped instance: with `hold`, its calls do not either). Its GenerateStream (what the
frontend calls) runs that Generate per started request.
Fake prefill: "transfers" after 10 ms; with `max_running` it takes that many calls at once
(more: RESOURCE_EXHAUSTED with RetryInfo, as a real one with its queue full), `hold` and
`is_stopped` as decode's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from tokenizers import AddedToken, Tokenizer, decoders, models

from mili import errors
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.frontend.v1 import generation_pb2_grpc
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.pb.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from mili.rpc.client import insecure_channel
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from mili.rpc.status import DETAILS_KEY, status_of
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.backends import Backends
from services.frontend.config import FrontendConfig
from services.frontend.generations import Generations
from services.frontend.router import Router
from services.frontend.server import GenerationServicer, add_to_server
from services.frontend.validation import Limits

CACHING = kv_pb2.PrefixCacheInfo(enabled=True)  # as a real instance's, by default

EOS = 99


def layout(block_size: int = 16) -> kv_pb2.KvLayout:
    return kv_pb2.KvLayout(
        block_size=block_size,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        block_order="block,slot,head,dim",
        model_fingerprint="fake",
    )


def ids(text: str) -> list[int]:
    return [ord(c) - 32 for c in text]


def text_of(token_ids: list[int]) -> str:
    return "".join(chr(i + 32) for i in token_ids if i != EOS)


@functools.cache
def tokenizer_file() -> bytes:
    """A tokenizer.json that decodes as `text_of`: id i is chr(i + 32), EOS a special token."""
    tokenizer = Tokenizer(models.WordLevel({chr(i + 32): i for i in range(EOS)}))
    tokenizer.decoder = decoders.Fuse()  # tokens joined as they are, no spaces between
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])  # id EOS
    return tokenizer.to_str().encode()


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    async def Tokenize(self, request: Any, context: Any) -> Any:
        text = request.text or "".join(m.content for m in request.messages)
        return tokenizer_pb2.TokenizeResponse(token_ids=ids(text), prompt=text)

    async def Info(self, request: Any, context: Any) -> Any:
        return tokenizer_pb2.InfoResponse(
            model="fake",
            vocab_size=100,
            eos_token_ids=[EOS],
            tokenizer_file_sha256=hashlib.sha256(tokenizer_file()).hexdigest(),
        )

    async def GetTokenizerFile(self, request: Any, context: Any) -> Any:
        data = tokenizer_file()
        return tokenizer_pb2.GetTokenizerFileResponse(
            tokenizer_json=data, sha256=hashlib.sha256(data).hexdigest()
        )


@dataclass
class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    script: list[list[int]] = field(default_factory=lambda: [ids("ab"), ids("c")])
    kv_layout: kv_pb2.KvLayout = field(default_factory=layout)
    full: bool = False
    fail_after: int | None = None
    requests: list[Any] = field(default_factory=list)
    num_closed: int = 0  # Generate calls that ended, however they ended
    kv_landed: asyncio.Event = field(default_factory=asyncio.Event)
    max_running: int | None = None
    hold: asyncio.Event | None = None
    hold_after: int = 0  # `hold` waits before this many of `script`'s events went out
    admitted: list[str] = field(default_factory=list)  # prompts admitted, in order
    num_reserved: int = 0  # requests admitted and not ended: their blocks are held
    transfer_error: Exception | None = None  # set with kv_landed: the transfer failed
    is_stopped: bool = False  # Info never answers
    num_total_blocks: int = 100  # what Info says of its KV pool (of 16-token blocks)
    num_free_blocks: int = 100

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        is_reserved = False
        try:
            if self.full or (
                self.max_running is not None and self.num_reserved >= self.max_running
            ):
                raise errors.ResourceExhausted("fake decode is full", retry_after_s=0.25)
            self.num_reserved += 1
            is_reserved = True
            self.admitted.append(text_of(list(request.prompt_token_ids)))
            yield decode_pb2.GenerateResponse(
                admitted=decode_pb2.Admitted(
                    prompt_block_ids=[1, 2], transfer_token="token-of-fake-decode"
                )
            )
            await self.kv_landed.wait()
            if self.transfer_error is not None:
                raise self.transfer_error
            for i, token_ids in enumerate(self.script):
                if self.hold is not None and i == self.hold_after:
                    await self.hold.wait()
                if self.fail_after is not None and i >= self.fail_after:
                    raise errors.Unavailable("fake decode lost its device")
                last = i == len(self.script) - 1
                if last and is_reserved:  # freed before the last event, as decode does
                    self.num_reserved -= 1
                    is_reserved = False
                yield decode_pb2.GenerateResponse(
                    tokens=decode_pb2.Tokens(
                        token_ids=token_ids,
                        finish_reason=sampling_pb2.FINISH_REASON_LENGTH if last else 0,
                    )
                )
                await asyncio.sleep(0.001)
        finally:
            self.num_closed += 1
            if is_reserved:
                self.num_reserved -= 1

    async def GenerateStream(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        """Generate, multiplexed: each started request runs `Generate` in a task of its own."""
        events: asyncio.Queue[Any] = asyncio.Queue()
        running: dict[str, asyncio.Task[None]] = {}

        async def run(request: Any) -> None:
            rid = request.request_id
            try:
                async for response in self.Generate(request, context):
                    kind = response.WhichOneof("event")
                    event = decode_pb2.StreamedEvent(request_id=rid)
                    getattr(event, kind).CopyFrom(getattr(response, kind))
                    events.put_nowait(event)
            except Exception as exc:
                status = status_of(exc, "/mili.decode.v1.DecodeService/Generate")
                details = dict(status.trailing_metadata).get(DETAILS_KEY, b"")
                error = decode_pb2.RequestError(
                    code=status.code.value[0], message=status.details, status_details=details
                )
                events.put_nowait(decode_pb2.StreamedEvent(request_id=rid, error=error))

        async def read() -> None:
            async for message in requests:
                for start in message.starts:
                    rid = start.request.request_id
                    running[rid] = asyncio.create_task(run(start.request))
                for rid in message.cancel_request_ids:
                    if rid in running:
                        running[rid].cancel()

        reader = asyncio.create_task(read())
        try:
            while True:
                yield decode_pb2.GenerateStreamResponse(events=[await events.get()])
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def Info(self, request: Any, context: Any) -> Any:
        if self.is_stopped:
            await asyncio.Event().wait()
        return decode_pb2.InfoResponse(
            model="fake",
            kv_layout=self.kv_layout,
            max_context_tokens=4096,
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            prefix_cache=CACHING,
        )


@dataclass
class FakePrefill(prefill_pb2_grpc.PrefillServiceServicer):
    decodes: dict[str, FakeDecode] = field(default_factory=dict)  # by address, to "transfer"
    kv_layout: kv_pb2.KvLayout = field(default_factory=layout)
    error: Exception | None = None
    # With `error`: the error decode reports for the broken transfer, before ours arrives
    decode_error: Exception | None = None
    # A decode instance that dies while we send it KV: we answer first (our KV destination went
    # away: PEER_UNAVAILABLE naming it), its Generate stream breaks (UNAVAILABLE) 0.1 s later
    lost: FakeDecode | None = None
    requests: list[Any] = field(default_factory=list)
    max_running: int | None = None
    hold: asyncio.Event | None = None
    hold_reply: asyncio.Event | None = None  # the KV sent, the reply waits for it
    num_running: int = 0  # calls taken and not ended
    is_stopped: bool = False  # Info never answers

    async def Prefill(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        if self.max_running is not None and self.num_running >= self.max_running:
            raise errors.ResourceExhausted("fake prefill queue is full", retry_after_s=0.25)
        self.num_running += 1
        try:
            await asyncio.sleep(0.01)
            if self.hold is not None:
                await self.hold.wait()
            address = request.destination.address
            lost = self.lost
            if lost is not None and self.decodes[address] is lost:

                def break_off() -> None:
                    lost.transfer_error = errors.Unavailable("fake decode went away")
                    lost.kv_landed.set()

                asyncio.get_running_loop().call_later(0.1, break_off)
                raise errors.PeerUnavailable(
                    f"the KV transfer to decode at {address} broke off", peer=address
                )
            if self.error is not None:
                if self.decode_error is not None:
                    decode = self.decodes[request.destination.address]
                    decode.transfer_error = self.decode_error
                    decode.kv_landed.set()
                    await asyncio.sleep(0.1)  # decode's error reaches the frontend first
                raise self.error
            self.decodes[request.destination.address].kv_landed.set()
            if self.hold_reply is not None:
                await self.hold_reply.wait()
            return prefill_pb2.PrefillResponse(
                num_prompt_tokens=len(request.prompt_token_ids), kv_bytes=64
            )
        finally:
            self.num_running -= 1

    async def Info(self, request: Any, context: Any) -> Any:
        if self.is_stopped:
            await asyncio.Event().wait()
        return prefill_pb2.InfoResponse(
            model="fake", kv_layout=self.kv_layout, max_prompt_tokens=4096, prefix_cache=CACHING
        )


async def _serve(name: str, service: str, register: Any) -> RpcServer:
    server = RpcServer(ServerConfig(drain_timeout_s=0.5, grace_s=0.1), name=name)
    server.add_service(service, register)
    await server.start()
    return server


@dataclass
class Stack:
    """Fakes plus a real frontend servicer; `stub` talks to the frontend over gRPC."""

    stub: generation_pb2_grpc.GenerationServiceStub
    backends: Backends
    decodes: list[FakeDecode]
    prefill: FakePrefill
    servers: dict[str, RpcServer]  # by address
    frontend: RpcServer  # its registry holds the frontend's metrics
    generations: Generations  # what the gRPC servicer runs (an HTTP app can share it)


@contextlib.asynccontextmanager
async def stack(
    decodes: list[FakeDecode] | None = None,
    prefill: FakePrefill | None = None,
    limits: Limits | None = None,
    max_buffered_tokens: int = 1024,
    stream_interval: int = 1,
    tokenizer: FakeTokenizer | None = None,
    max_queued_requests: int = 512,
    max_queued_tokens: int = 1 << 20,
    poll_interval_s: float = 0.05,
    spare_prefills: Sequence[FakePrefill] = (),
) -> AsyncIterator[Stack]:
    """`spare_prefills`: prefill instances after `prefill`, the router's later choices."""
    decodes = decodes if decodes is not None else [FakeDecode()]
    prefill = prefill or FakePrefill()
    servers: dict[str, RpcServer] = {}

    async def serve(name: str, service: str, register: Any) -> str:
        server = await _serve(name, service, register)
        servers[server.address] = server
        return server.address

    tokenizer = tokenizer or FakeTokenizer()
    tokenizer_address = await serve(
        "tokenizer",
        "mili.tokenizer.v1.TokenizerService",
        lambda s: tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(tokenizer, s),
    )
    prefill_addresses = [
        await serve(
            "prefill",
            "mili.prefill.v1.PrefillService",
            lambda s, p=p: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(p, s),
        )
        for p in (prefill, *spare_prefills)
    ]
    decode_addresses = []
    for decode in decodes:
        address = await serve(
            "decode",
            "mili.decode.v1.DecodeService",
            lambda s, d=decode: decode_pb2_grpc.add_DecodeServiceServicer_to_server(d, s),
        )
        for p in (prefill, *spare_prefills):
            p.decodes[address] = decode
        decode_addresses.append(address)
    config = FrontendConfig(
        tokenizer_address=tokenizer_address,
        prefill_addresses=tuple(prefill_addresses),
        decode_addresses=tuple(decode_addresses),
        limits=limits or Limits(default_max_tokens=16),
        poll_interval_s=poll_interval_s,
        info_timeout_s=0.5,
        hung_after_s=1.0,  # two polls past their timeout
        max_buffered_tokens=max_buffered_tokens,
        stream_interval=stream_interval,
        max_queued_requests=max_queued_requests,
        max_queued_tokens=max_queued_tokens,
    )
    frontend = RpcServer(ServerConfig(drain_timeout_s=0.5, grace_s=0.1), name="frontend")
    metrics = FrontendMetrics(frontend.registry)
    backends = Backends(
        config, Router(config.prefill_addresses, config.decode_addresses), metrics=metrics
    )
    generations = Generations(backends, metrics)
    add_to_server(frontend, GenerationServicer(generations))
    await backends.start()
    await frontend.start()
    channel = insecure_channel(frontend.address)
    try:
        yield Stack(
            generation_pb2_grpc.GenerationServiceStub(channel),
            backends,
            decodes,
            prefill,
            servers,
            frontend,
            generations,
        )
    finally:
        await channel.close()
        await frontend.drain()
        await backends.close()
        for server in servers.values():
            with contextlib.suppress(Exception):
                await server.drain()


async def wait_until(predicate: Any, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def collect(call: Any) -> list[Any]:
    return [r async for r in call]


def code_of(err: grpc.aio.AioRpcError) -> grpc.StatusCode:
    code: grpc.StatusCode = err.code()
    return code
