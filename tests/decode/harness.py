"""Test harness for the decode service: an in-process server, a stand-in prefill, a client.

- `DecodeServerThread`: a real DecodeInstance + RpcServer on 127.0.0.1 port 0, its event loop in
  a background thread. Tests run their client coroutines on that same loop (`server.run(...)`),
  so a module-scoped server outlives each test's client without juggling event loops.
- `PrefillPlayer`: plays the prefill instance. It runs the prompt through the engine's prefill on
  a local copy of the model and KV cache, samples the first token, and ships the KV blocks over a
  real TransferKv stream exactly as prefill will (header, one chunk per layer, commit).
- `run_request`: Generate + transfer + collect the stream, the whole life of one request.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from mili.discovery import Callers
from mili.engine.generate import generate
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.model.fingerprint import model_fingerprint
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import PrefillBatch
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.sampler import Sampler, SequenceSampling
from mili.kv_handoff.codec import encode_chunk_request
from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.kv.v1 import kv_pb2, kv_pb2_grpc
from mili.rpc.kv_layout import layout_to_proto
from mili.rpc.sampling import sampling_params_to_proto
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from services.decode.config import DecodeConfig
from services.decode.instance import DecodeInstance
from services.decode.server import add_to_server

T = TypeVar("T")


class DecodeServerThread:
    """A decode service in this process; `close()` drains it and stops the batch thread."""

    def __init__(
        self,
        config: DecodeConfig,
        *,
        server_config: ServerConfig | None = None,
        frontends: Callers | None = None,
        prefills: Callers | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.instance = DecodeInstance.load(config)
        self.instance.start(on_death)
        server_config = server_config or ServerConfig(drain_timeout_s=2.0, grace_s=0.5)
        self.server = RpcServer(server_config, name="decode")
        add_to_server(self.server, self.instance, frontends=frontends, prefills=prefills)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),))
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("decode server did not start")

    async def _main(self) -> None:
        self._closing = asyncio.Event()
        await self.server.start()
        self._ready.set()
        await self._closing.wait()
        await self.server.drain()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run a test's client coroutine on the server's loop; return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._closing.set)
        self._thread.join(30)
        self._loop.close()
        self.instance.stop()


@dataclass
class Prefilled:
    first_token_id: int
    first_logprobs: sampling_pb2.Logprobs | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [n_blocks, S, KVH, D]


class PrefillPlayer:
    """A stand-in prefill instance over the same checkpoint (its own model and KV cache)."""

    def __init__(self, model_dir: Path, block_size: int) -> None:
        self.model = load_model(model_dir)
        self.block_size = block_size
        self.fingerprint = model_fingerprint(model_dir)
        self.vocab_size = self.model.config.vocab_size

    def layout(self, **overrides: Any) -> kv_pb2.KvLayout:
        cache = KVCache(self.model.config, 1, self.block_size, dtype=self.model.dtype)
        layout = layout_to_proto(cache.layout, self.fingerprint)
        for name, value in overrides.items():
            setattr(layout, name, value)
        return layout

    def reference(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """Tokens of the single-process engine run (mili.engine.generate)."""
        return generate(self.model, [prompt], params, block_size=self.block_size)[0].token_ids

    def prefill(self, prompt: Sequence[int], params: SamplingParams) -> Prefilled:
        num_blocks = blocks_needed(len(prompt), self.block_size)
        cache = KVCache(self.model.config, num_blocks, self.block_size, dtype=self.model.dtype)
        table = list(range(num_blocks))
        batch = PrefillBatch.build([list(prompt)], [table], self.block_size)
        logits = self.model.prefill(batch, cache)  # [1, vocab]
        out = Sampler()(logits, [SequenceSampling(params, prompt, self.vocab_size)])
        first_logprobs = None
        if out.logprobs is not None and out.top_logprobs is not None:
            chosen = sampling_pb2.TokenLogprob(token_id=out.token_ids[0], logprob=out.logprobs[0])
            first_logprobs = sampling_pb2.Logprobs(
                chosen=chosen,
                top=[
                    sampling_pb2.TokenLogprob(token_id=t, logprob=lp)
                    for t, lp in out.top_logprobs[0]
                ],
            )
        blocks = cache.gather_layers(0, cache.num_layers, cache.block_index(table))
        kv = [(blocks[layer, 0], blocks[layer, 1]) for layer in range(cache.num_layers)]
        return Prefilled(out.token_ids[0], first_logprobs, kv)

    def messages(
        self,
        request_id: str,
        prompt: Sequence[int],
        block_ids: Sequence[int],
        prefilled: Prefilled,
        layout: kv_pb2.KvLayout | None = None,
    ) -> list[kv_pb2.TransferKvRequest]:
        """header, one chunk per layer (into the decode side's `block_ids`), commit. The header
        carries the reservation's transfer token when `block_ids` is a `Reserved`, whose leading
        `num_cached_blocks` (decode's prefix cache has them) are not sent, as prefill does."""
        skip = getattr(block_ids, "num_cached_blocks", 0)
        ids = list(block_ids)[skip:]
        chunks = [
            kv_pb2.TransferKvRequest.FromString(
                encode_chunk_request(request_id, layer, layer, ids, k[skip:], v[skip:])[0]
            ).chunk
            for layer, (k, v) in enumerate(prefilled.kv)
        ]
        header = kv_pb2.TransferHeader(
            request_id=request_id,
            layout=layout if layout is not None else self.layout(),
            num_tokens=len(prompt),
            num_chunks=len(chunks),
            transfer_token=getattr(block_ids, "transfer_token", ""),
        )
        commit = kv_pb2.TransferCommit(first_token_id=prefilled.first_token_id)
        if prefilled.first_logprobs is not None:
            commit.first_logprobs.CopyFrom(prefilled.first_logprobs)
        return [
            kv_pb2.TransferKvRequest(header=header),
            *(kv_pb2.TransferKvRequest(chunk=c) for c in chunks),
            kv_pb2.TransferKvRequest(commit=commit),
        ]


def sampling(params: SamplingParams) -> sampling_pb2.SamplingParams:
    """The proto form of engine params (what the frontend sends)."""
    return sampling_params_to_proto(params)


@dataclass
class Outcome:
    """What a Generate stream delivered."""

    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[sampling_pb2.Logprobs] = field(default_factory=list)
    finish_reason: int = 0
    num_events: int = 0


class Reserved(list[int]):
    """The prompt block ids decode reserved, and the token its transfer must carry."""

    def __init__(
        self, block_ids: Sequence[int], transfer_token: str, num_cached_blocks: int = 0
    ) -> None:
        super().__init__(block_ids)
        self.transfer_token = transfer_token
        self.num_cached_blocks = num_cached_blocks  # decode holds these already: not sent


class Client:
    """Stubs for both services on one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.decode = decode_pb2_grpc.DecodeServiceStub(channel)
        self.kv = kv_pb2_grpc.KvTransferServiceStub(channel)
        self.layout: kv_pb2.KvLayout | None = None  # the instance's, once Info was called

    async def info(self) -> decode_pb2.InfoResponse:
        info = await self.decode.Info(decode_pb2.InfoRequest(), timeout=5)
        self.layout = info.kv_layout
        return info

    def generate(self, request: decode_pb2.GenerateRequest, timeout: float) -> Any:
        """decode.Generate with the instance's own layout as prefill's (what a frontend sends
        for a compatible pair) unless `request` names one; call `info()` once first."""
        if not request.HasField("prefill_layout"):
            assert self.layout is not None, "call info() first"
            request.prefill_layout.CopyFrom(self.layout)
        return self.decode.Generate(request, timeout=timeout)

    async def admit(self, request: decode_pb2.GenerateRequest) -> tuple[Any, Reserved]:
        """Start Generate; return the call and the reservation."""
        if self.layout is None:
            await self.info()
        call = self.generate(request, timeout=30)
        first = await call.read()
        assert first.WhichOneof("event") == "admitted", first
        admitted = first.admitted
        return call, Reserved(
            admitted.prompt_block_ids, admitted.transfer_token, admitted.num_cached_blocks
        )

    async def collect(self, call: Any, outcome: Outcome) -> Outcome:
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens = response.tokens
            outcome.num_events += 1
            outcome.token_ids.extend(tokens.token_ids)
            outcome.logprobs.extend(tokens.logprobs)
            if tokens.finish_reason:
                outcome.finish_reason = tokens.finish_reason
        return outcome

    async def transfer_and_collect(
        self,
        player: PrefillPlayer,
        request_id: str,
        prompt: Sequence[int],
        admitted: tuple[Any, Reserved],
        prefilled: Prefilled,
    ) -> Outcome:
        """Prefill's side of an admitted request (`admitted`: `admit`'s call and reservation):
        its KV and the commit; then its tokens to the end."""
        call, block_ids = admitted
        transfer = self.kv.TransferKv(timeout=30)
        for message in player.messages(request_id, prompt, block_ids, prefilled):
            await transfer.write(message)
        await transfer.done_writing()
        await transfer
        return await self.collect(call, Outcome(block_ids=list(block_ids)))

    async def run_request(
        self,
        player: PrefillPlayer,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        before_commit: Callable[[], Awaitable[Any]] | None = None,
    ) -> Outcome:
        """Admit, transfer the KV (prefill played locally), collect tokens to the end."""
        request = decode_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=list(prompt), sampling=sampling(params)
        )
        call, block_ids = await self.admit(request)
        prefilled = await asyncio.to_thread(player.prefill, prompt, params)
        messages = player.messages(request_id, prompt, block_ids, prefilled)
        transfer = self.kv.TransferKv(timeout=30)
        for message in messages[:-1]:
            await transfer.write(message)
        if before_commit is not None:
            await before_commit()
        await transfer.write(messages[-1])
        await transfer.done_writing()
        reply = await transfer
        assert reply.num_blocks == len(block_ids) - block_ids.num_cached_blocks
        return await self.collect(call, Outcome(block_ids=list(block_ids)))


def random_prompt(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


async def eventually(check: Callable[[], Any], timeout_s: float = 3.0) -> None:
    """Poll `check` (sync or async, truthy = done) every 10 ms until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition still false after {timeout_s} s")
        await asyncio.sleep(0.01)


async def blocks_back(client: Client, num_free: int, timeout_s: float = 2.0) -> None:
    """Wait until Info reports `num_free` free blocks and nothing admitted."""

    async def check() -> bool:
        info = await client.info()
        return info.num_free_blocks == num_free and info.num_running == info.num_waiting == 0

    await eventually(check, timeout_s)
