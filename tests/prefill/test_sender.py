"""KvSender's pipeline against a real receiver: the encoder threads get the next chunks before a
chunk is written, so encoding overlaps the writes instead of waiting behind them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from mili.engine.sampling_params import SamplingParams
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
            layers = [kv_cache.gather_blocks(i, [0, 1, 2]) for i in range(num_layers)]
            async with receiver_for(h) as (receiver, server):
                receiver.reserve("pipelined", [0, 1, 2])
                ids = random_ids(40, tiny.model.config.vocab_size, seed=3)
                async with insecure_channel(server.address) as channel:
                    with RecordingEncoder(events) as encoder:
                        sender = KvSender(
                            PrefillTask(
                                "pipelined", ids, SamplingParams(), server.address, [0, 1, 2]
                            ),
                            channel=channel,
                            encoder=encoder,
                            layout=h.servicer.layout,
                            num_chunks=num_layers,
                            timeout_s=10,
                        )

                        def push() -> None:
                            for layer, (k, v) in enumerate(layers):
                                sender.send_blocks(layer, 0, k, v, None)
                            sender.finish(FirstToken(0, None, None, 0.0, 0.0))

                        result = await sender.run(push)
                transfer = receiver.transfers["pipelined"]
                assert transfer.status == "ok"
                assert [c.seq for c in transfer.chunks] == list(range(num_layers))
                assert result.kv_bytes == sum(k.nbytes + v.nbytes for k, v in layers)

    asyncio.run(main())
    assert events.index(("submit", limit)) < events.index(("write", 1))
    assert [e for e in events if e[0] == "submit"] == [("submit", i) for i in range(num_layers)]
