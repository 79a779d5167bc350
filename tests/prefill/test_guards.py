"""Prefill takes prompts only from its frontends, and only as large as a prompt it could run:
a caller outside --frontend is PERMISSION_DENIED before anything is queued; a request over
Prefill's limit (a prompt of max_prompt_tokens with its block ids) is refused by grpc from its
length prefix, unread; one of more ids than max_prompt_tokens is INVALID_ARGUMENT before the
ids are converted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mili.discovery import Callers, PeerSet, parse_targets
from tests.prefill.harness import TinyModel, prefill_request, prefill_service, random_ids


def test_prefill_from_outside_its_frontends_queues_nothing(tiny: TinyModel) -> None:
    elsewhere = Callers("--frontend", PeerSet(parse_targets(["127.0.0.9:50051"])))

    async def main() -> None:
        async with prefill_service(tiny, frontends=elsewhere) as h:
            request = prefill_request("r", random_ids(40, 512, seed=1), "127.0.0.1:9", [0, 1, 2])
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await h.stub.Prefill(request, timeout=10)
            assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "--frontend 127.0.0.9:50051" in (caught.value.details() or "")
            assert h.num_free_blocks == h.num_total_blocks
            assert h.servicer.worker.num_queued_tokens == 0

    asyncio.run(main())


def test_a_prefill_request_over_its_size_or_length_is_refused_unconverted(tiny: TinyModel) -> None:
    async def main() -> None:
        async with prefill_service(tiny) as h:
            max_tokens = h.servicer.max_prompt_tokens
            huge = prefill_request("r", [300] * 2_000_000, "127.0.0.1:9", [0])  # 4 MB
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await h.stub.Prefill(huge, timeout=10)
            assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in (caught.value.details() or "")  # grpc's, unread
            long = prefill_request("r", [300] * (max_tokens + 1), "127.0.0.1:9", [0])
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await h.stub.Prefill(long, timeout=10)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"longer than this instance's max_prompt_tokens {max_tokens}" in (
                caught.value.details() or ""
            )

    asyncio.run(main())
