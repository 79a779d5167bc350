"""Test harness: an in-process prefill service on a real port, a KV receiver, reference decode.

pytest-asyncio is not a dependency: each test runs `asyncio.run(...)` and opens what it needs
inside it (`async with prefill_service(...)`, `async with receiver_for(...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from mili.discovery import ANY
from mili.engine.engine_config import EngineConfig
from mili.engine.kv.block_pool import blocks_needed
from mili.engine.model.config import Qwen3Config
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.qwen3 import DecodeBatch, Qwen3ForCausalLM
from mili.engine.step.runner import ModelRunner
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from mili.rpc.client import insecure_channel
from mili.rpc.server import RpcServer
from mili.rpc.server_config import ServerConfig
from services.prefill.config import PrefillConfig
from services.prefill.instance import PrefillInstance
from services.prefill.server import PrefillServicer, add_to_server
from tests.prefill.receiver import KvReceiver, serve_receiver

# Wide enough that one layer of a few hundred tokens takes milliseconds (the overlap test needs
# compute to outlast a chunk's trip), small enough to load in well under a second. fp32 and
# std 0.1 keep greedy argmax clear of float near-ties between batched/chunked and plain runs.
TINY = Qwen3Config(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    torch_dtype="float32",
    eos_token_id=1,
)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class TinyModel:
    path: Path
    model: Qwen3ForCausalLM
    fingerprint: str


def random_ids(n: int, vocab_size: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


@dataclass
class PrefillHarness:
    servicer: PrefillServicer
    stub: prefill_pb2_grpc.PrefillServiceStub

    @property
    def num_free_blocks(self) -> int:
        return self.servicer.worker.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.servicer.worker.num_total_blocks


@contextlib.asynccontextmanager
async def prefill_service(tiny: TinyModel, **config: Any) -> AsyncIterator[PrefillHarness]:
    """A started prefill server; on exit asserts every block is free and nothing is queued.
    `vocab_size`: the tokenizer's (default: the model's rows); `frontends`: who may call
    Prefill (default: this machine); `eos_token_ids`: the model's (default none); `on_death`:
    the worker's (PrefillWorker.start)."""
    # Any destination by default: these tests aim at receivers on ports chosen as they run.
    num_blocks = config.pop("num_blocks", 128)
    vocab_size = config.pop("vocab_size", None)
    frontends = config.pop("frontends", None)
    eos_token_ids = config.pop("eos_token_ids", ())
    on_death = config.pop("on_death", None)
    settings = {"max_batch_tokens": 64, "allowed_decodes": (ANY,), **config}
    prefill_config = PrefillConfig(engine=EngineConfig(block_size=BLOCK_SIZE), **settings)
    runner = ModelRunner.create(tiny.model, num_blocks, BLOCK_SIZE, vocab_size=vocab_size)
    instance = PrefillInstance.create(
        runner,
        prefill_config,
        model_name=tiny.path.name,
        fingerprint=tiny.fingerprint,
        eos_token_ids=eos_token_ids,
    )
    servicer = PrefillServicer(instance, max_message_bytes=64 << 20, on_death=on_death)
    server = RpcServer(ServerConfig(drain_timeout_s=2.0, grace_s=0.5), name="prefill")
    add_to_server(server, servicer, frontends=frontends)
    port = await server.start()
    channel = insecure_channel(f"127.0.0.1:{port}")
    harness = PrefillHarness(servicer, prefill_pb2_grpc.PrefillServiceStub(channel))
    try:
        yield harness
        # No leaked blocks: every path frees them (a cancelled call's handler may finish a
        # moment after the client saw CANCELLED, hence the wait).
        await until(lambda: harness.num_free_blocks == harness.num_total_blocks)
        assert servicer.worker.num_queued_tokens == 0
    finally:
        await channel.close()
        await server.drain()
        await servicer.close()


def receiver_cache(tiny: TinyModel, num_blocks: int = 96) -> KVCache:
    return KVCache(tiny.model.config, num_blocks, BLOCK_SIZE, dtype=tiny.model.dtype)


@contextlib.asynccontextmanager
async def receiver_for(
    harness: PrefillHarness, *, cache: KVCache | None = None, layout: kv_pb2.KvLayout | None = None
) -> AsyncIterator[tuple[KvReceiver, grpc.aio.Server]]:
    """A KV receiver with the prefill's layout (or `layout`); `server.address` is its address."""
    receiver = KvReceiver(layout or harness.servicer.layout, cache)
    async with serve_receiver(receiver) as server:
        try:
            yield receiver, server
        finally:
            receiver.resume.set()
            receiver.hold_ack.set()


def prefill_request(
    request_id: str,
    token_ids: list[int],
    address: str,
    block_ids: list[int],
    transfer_token: str = "",
    **sampling: Any,
) -> prefill_pb2.PrefillRequest:
    """`block_ids`: what decode reserved (its output's blocks may follow the prompt's); the
    request names the prompt's, as decode's Admitted.prompt_block_ids does."""
    from mili.pb.common.v1 import sampling_pb2

    prompt_block_ids = block_ids[: blocks_needed(len(token_ids), BLOCK_SIZE)]
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=token_ids,
        sampling=sampling_pb2.SamplingParams(**{"temperature": 0.0, **sampling}),
        destination=prefill_pb2.KvDestination(
            address=address, prompt_block_ids=prompt_block_ids, transfer_token=transfer_token
        ),
    )


def greedy_continue(
    model: Qwen3ForCausalLM,
    cache: KVCache,
    block_table: list[int],
    num_prompt_tokens: int,
    first_token: int,
    num_tokens: int,
) -> list[int]:
    """Decode greedily from a cache that holds the prompt's KV, as decode would."""
    tokens = [first_token]
    while len(tokens) < num_tokens:
        position = num_prompt_tokens + len(tokens) - 1
        batch = DecodeBatch.build([tokens[-1]], [position], [block_table], cache.block_size)
        tokens.append(int(model.decode(batch, cache).argmax(-1)[0]))
    return tokens


async def until(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Poll `check` (sync or async; truthy = done) every 10 ms until it holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition still false after {timeout_s} s")
        await asyncio.sleep(0.01)
