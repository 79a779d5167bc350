"""Proto <-> domain conversions of the decode service (the only place besides the servicers that
imports generated *_pb2 modules)."""

from __future__ import annotations

from mili.decode.v1 import decode_pb2
from mili.engine.kv_layout import KVLayout
from mili.kv.v1 import kv_pb2
from mili.rpc.kv_layout import layout_to_proto
from mili.rpc.sampling import finish_reason_to_proto, logprobs_to_proto
from services.decode.requests import DecodeRequest
from services.decode.stream import TokenEvent


def layout(kv_layout: KVLayout, model_fingerprint: str) -> kv_pb2.KvLayout:
    return layout_to_proto(kv_layout, model_fingerprint)


def admitted(request: DecodeRequest) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(
        admitted=decode_pb2.Admitted(
            prompt_block_ids=request.prompt_block_ids,
            kv_lease_ms=request.lease_ms,
            transfer_token=request.transfer_token,
            num_cached_blocks=request.num_cached_blocks,
        )
    )


def tokens(event: TokenEvent) -> decode_pb2.GenerateResponse:
    logprobs = []
    if event.logprobs is not None:
        logprobs = [
            logprobs_to_proto(t, lp) for t, lp in zip(event.token_ids, event.logprobs, strict=True)
        ]
    return decode_pb2.GenerateResponse(
        tokens=decode_pb2.Tokens(
            token_ids=event.token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason_to_proto(event.finish_reason),
        )
    )
