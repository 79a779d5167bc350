"""KvSender's pipeline against a real receiver: the encoder threads get the next chunks before a
chunk is written, so encoding overlaps the writes instead of waiting behind them; a failed
transfer holds on to none of the host copies handed to it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from mili.engine.sampling_params import SamplingParams
from mili.engine.step.pinned import StagingRing
from mili.errors import Unavailable
from mili.rpc.client import insecure_channel
from services.prefill import sender as sender_module
from services.prefill.sender import KvSender
from services.prefill.task import FirstToken, PrefillTask
from tests.prefill.harness import TinyModel, prefill_service, random_ids, receiver_for


class RecordingEncoder(ThreadPoolExecutor):
    """Two encoder threads that log each job handed to them in `events`."""

    def __init__(self, events: list[tuple[str, int]]) -> None:
        super().__init__(2)
        self._events = events
        self._num_jobs = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self._events.append(("submit", self._num_jobs))  # the event loop's thread
        self._num_jobs += 1
        return super().submit(fn, *args, **kwargs)


def _sender(
    h: Any, request_id: str, ids: list[int], channel: Any, encoder: Any, address: str
) -> KvSender:
    """A sender of every layer of blocks 0, 1, 2 of `request_id` to the receiver at `address`."""
    return KvSender(
        PrefillTask(request_id, ids, SamplingParams(), address, [0, 1, 2]),
        channel=channel,
        encoder=encoder,
        layout=h.servicer.layout,
        num_chunks=h.servicer.worker.kv_cache.num_layers,
        timeout_s=10,
    )


def test_the_next_chunks_are_encoding_while_a_chunk_is_written(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer is handed over at once (more than _MAX_ENCODING chunks): once the first
    chunk is encoded, the encoder gets chunk _MAX_ENCODING before that chunk's write starts;
    every chunk arrives, in order, and the receiver acknowledges."""
    events: list[tuple[str, int]] = []
    write = KvSender._write
    num_writes = 0

    async def spy(self: KvSender, call: grpc.aio.StreamUnaryCall, message: bytes) -> None:
        nonlocal num_writes
        events.append(("write", num_writes))  # 0 is the header
        num_writes += 1
        await write(self, call, message)

    monkeypatch.setattr(KvSender, "_write", spy)
    num_layers = tiny.model.config.num_hidden_layers
    limit = sender_module._MAX_ENCODING
    assert num_layers > limit

    async def main() -> None:
        async with prefill_service(tiny) as h:
            kv_cache = h.servicer.worker.kv_cache
            index = kv_cache.block_index([0, 1, 2])
            layers = [kv_cache.gather_layers(i, i + 1, index) for i in range(num_layers)]
            async with receiver_for(h) as (receiver, server):
                receiver.reserve("pipelined", [0, 1, 2])
                ids = random_ids(40, tiny.model.config.vocab_size, seed=3)
                async with insecure_channel(server.address) as channel:
                    with RecordingEncoder(events) as encoder:
                        sender = _sender(h, "pipelined", ids, channel, encoder, server.address)

                        def push() -> None:
                            for layer, kv in enumerate(layers):
                                sender.send_blocks(layer, 0, kv, None)
                            sender.finish(FirstToken(0, None, None, 0.0, 0.0))

                        result = await sender.run(push, lambda: None)
                transfer = receiver.transfers["pipelined"]
                assert transfer.status == "ok"
                assert [c.seq for c in transfer.chunks] == list(range(num_layers))
                assert result.kv_bytes == sum(kv.nbytes for kv in layers)

    asyncio.run(main())
    assert events.index(("submit", limit)) < events.index(("write", 1))
    assert [e for e in events if e[0] == "submit"] == [("submit", i) for i in range(num_layers)]


def test_a_failed_transfer_keeps_none_of_the_host_copies_handed_to_it(tiny: TinyModel) -> None:
    """Layers handed over after the worker's failure (a stopping worker fails its prompts while
    its running step still ships layers) are dropped with the transfer: their staging ring
    spans come back although the sender object lives on."""
    staging = StagingRing(1 << 20, torch.device("cpu"))

    async def main() -> KvSender:
        async with prefill_service(tiny) as h:
            kv_cache = h.servicer.worker.kv_cache
            async with receiver_for(h) as (receiver, server):
                receiver.reserve("stopped", [0, 1, 2])
                ids = random_ids(40, tiny.model.config.vocab_size, seed=4)
                async with insecure_channel(server.address) as channel:
                    with ThreadPoolExecutor(2) as encoder:
                        sender = _sender(h, "stopped", ids, channel, encoder, server.address)

                        def push() -> None:
                            sender.fail(Unavailable("prefill instance is shutting down"))
                            index = kv_cache.block_index([0, 1, 2])
                            for layer in range(3):
                                kv = kv_cache.gather_layers(layer, layer + 1, index)
                                staged = staging.empty(kv.shape, kv.dtype)
                                assert staged is not None
                                staged.copy_(kv)
                                sender.send_blocks(layer, 0, staged, None)

                        with pytest.raises(Unavailable):
                            await sender.run(push, lambda: None)
        return sender

    sender = asyncio.run(main())
    gc.collect()
    assert sender is not None
    assert staging.num_held == 0
