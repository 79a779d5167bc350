"""The frontend's own metrics over real gRPC against the fakes (see fakes.py): requests in
flight while one waits on prefill, and the generated tokens sent to clients, counted once per
response message (Generate) or per reply (Complete)."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2
from tests.frontend.fakes import FakePrefill, collect, stack, wait_until


class GatedPrefill(FakePrefill):
    """Holds every Prefill call until `gate` is set: the request stays in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def Prefill(self, request: Any, context: Any) -> Any:
        await self.gate.wait()
        return await super().Prefill(request, context)


def _value(registry: CollectorRegistry, name: str) -> float:
    found = registry.get_sample_value(name)
    assert found is not None, f"{name} is not exported"
    return found


def test_in_flight_requests_and_generated_tokens() -> None:
    async def main() -> None:
        prefill = GatedPrefill()
        async with stack(prefill=prefill) as s:
            registry = s.frontend.registry
            assert _value(registry, "mili_frontend_in_flight_requests") == 0
            assert _value(registry, "mili_frontend_generated_tokens_total") == 0
            request = generation_pb2.GenerateRequest(
                prompt="hi", sampling=sampling_pb2.SamplingParams(max_tokens=8)
            )
            held = [asyncio.create_task(collect(s.stub.Generate(request, timeout=5)))]
            held.append(asyncio.ensure_future(s.stub.Complete(request, timeout=5)))
            await wait_until(lambda: _value(registry, "mili_frontend_in_flight_requests") == 2)
            assert _value(registry, "mili_frontend_generated_tokens_total") == 0
            prefill.gate.set()
            responses, reply = await asyncio.gather(*held)
            # The fake decode streams "ab" then "c": 3 tokens each, 6 sent in all.
            assert sum(len(r.token_ids) for r in responses) == 3
            assert len(reply.token_ids) == 3
            assert _value(registry, "mili_frontend_generated_tokens_total") == 6
            assert _value(registry, "mili_frontend_in_flight_requests") == 0

    asyncio.run(main())
