"""A decode (or prefill) instance that replays pre-generated token ids at a set step rate: the
frontend's ceiling, measured without a model that cannot keep up on this CPU.

A real gRPC server on 127.0.0.1 port 0 speaking the same protocol the frontend speaks to decode
and prefill; the frontend under test is the real one, unchanged:

    --role decode   DecodeService: Info (a fixed KV layout, free blocks), GenerateStream (each
                    start admitted at once; then every --step-ms, one message carrying the next
                    token of every running request, as decode's batch step does; LENGTH at
                    max_tokens; cancels honoured) and Generate (the same, one request per call)
    --role prefill  PrefillService: Info (the same layout), Prefill (replies at once; no KV is
                    sent: the stand-in decode does not wait for any)

Token ids are drawn once, uniformly from [0, --vocab), seeded, so the frontend's detokenizer
sees the realistic mix of the benchmark's tokenizer. Prints "service listening on ADDRESS" like
the real services, which benchmarks/token_path.py reads.

    python benchmarks/decode_standin.py --role decode --model-name token-path-fit-v4096 --step-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from mili.pb.common.v1 import sampling_pb2
from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
from mili.pb.kv.v1 import kv_pb2
from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc

_LAYOUT = kv_pb2.KvLayout(
    block_size=16,
    num_layers=1,
    num_kv_heads=1,
    head_dim=32,
    dtype="float32",
    block_order="layer,kv,block,head,slot,dim",
    model_fingerprint="decode-standin",
)
_NUM_BLOCKS = 1 << 20
_CONTEXT = 1 << 16


@dataclass
class _Running:
    request_id: str
    max_tokens: int
    num_sent: int = 0


class StandInDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, model: str, step_s: float, token_ids: list[int]) -> None:
        self._model = model
        self._step_s = step_s
        self._token_ids = token_ids

    def _next(self, running: _Running, n: int = 1) -> decode_pb2.Tokens:
        start = running.num_sent
        n = min(n, running.max_tokens - start)
        running.num_sent += n
        ids = [self._token_ids[(start + i) % len(self._token_ids)] for i in range(n)]
        is_last = running.num_sent >= running.max_tokens
        return decode_pb2.Tokens(
            token_ids=ids,
            finish_reason=(
                sampling_pb2.FINISH_REASON_LENGTH
                if is_last
                else sampling_pb2.FINISH_REASON_UNSPECIFIED
            ),
        )

    async def GenerateStream(
        self, requests: AsyncIterator[decode_pb2.GenerateStreamRequest], context: object
    ) -> AsyncIterator[decode_pb2.GenerateStreamResponse]:
        running: dict[str, _Running] = {}
        admitted: list[decode_pb2.StreamedEvent] = []
        is_done = False

        async def read() -> None:
            nonlocal is_done
            async for message in requests:
                for start in message.starts:
                    request = start.request
                    rid = request.request_id
                    running[rid] = _Running(rid, request.sampling.max_tokens or 16)
                    admitted.append(
                        decode_pb2.StreamedEvent(
                            request_id=rid,
                            admitted=decode_pb2.Admitted(
                                prompt_block_ids=[1], transfer_token="standin"
                            ),
                        )
                    )
                for rid in message.cancel_request_ids:
                    running.pop(rid, None)
            is_done = True

        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        try:
            while not (is_done and not running):
                # One decode step: admissions since the last, then one token for every request
                # admitted before it (the first token waits a step, as prefill's would).
                next_step += self._step_s
                await asyncio.sleep(max(0.0, next_step - loop.time()))
                events, admitted[:] = list(admitted), []
                fresh = {e.request_id for e in events}
                for rid, r in list(running.items()):
                    if rid in fresh:
                        continue
                    tokens = self._next(r)
                    events.append(decode_pb2.StreamedEvent(request_id=rid, tokens=tokens))
                    if tokens.finish_reason:
                        del running[rid]
                if events:
                    yield decode_pb2.GenerateStreamResponse(events=events)
        finally:
            reader.cancel()

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: object
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        yield decode_pb2.GenerateResponse(
            admitted=decode_pb2.Admitted(prompt_block_ids=[1], transfer_token="standin")
        )
        r = _Running(request.request_id, request.sampling.max_tokens or 16)
        while r.num_sent < r.max_tokens:
            await asyncio.sleep(self._step_s)
            yield decode_pb2.GenerateResponse(tokens=self._next(r))

    async def Info(self, request: decode_pb2.InfoRequest, context: object) -> object:
        return decode_pb2.InfoResponse(
            model=self._model,
            dtype="float32",
            device="cpu",
            kv_layout=_LAYOUT,
            attention_backend="stand-in",
            max_context_tokens=_CONTEXT,
            max_running=1 << 16,
            num_total_blocks=_NUM_BLOCKS,
            num_free_blocks=_NUM_BLOCKS,
        )


class StandInPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, model: str) -> None:
        self._model = model

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: object) -> object:
        return prefill_pb2.PrefillResponse()

    async def Info(self, request: prefill_pb2.InfoRequest, context: object) -> object:
        return prefill_pb2.InfoResponse(
            model=self._model,
            dtype="float32",
            device="cpu",
            kv_layout=_LAYOUT,
            attention_backend="stand-in",
            max_prompt_tokens=_CONTEXT,
            num_total_blocks=_NUM_BLOCKS,
            num_free_blocks=_NUM_BLOCKS,
        )


async def serve(args: argparse.Namespace) -> None:
    server = grpc.aio.server()
    if args.role == "decode":
        rng = random.Random(0)
        token_ids = [rng.randrange(args.vocab) for _ in range(1 << 16)]
        decode = StandInDecode(args.model_name, args.step_ms / 1000, token_ids)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, server)
    else:
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(
            StandInPrefill(args.model_name), server
        )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"{args.role} service listening on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("decode", "prefill"), required=True)
    parser.add_argument("--model-name", required=True, help="the tokenizer's model name")
    parser.add_argument("--step-ms", type=float, default=10.0, help="decode step interval")
    parser.add_argument("--vocab", type=int, default=4096, help="token ids drawn below this")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
