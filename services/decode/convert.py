"""Proto <-> domain conversions of the decode service (the only place besides the servicers that
imports generated *_pb2 modules)."""

from __future__ import annotations

from mili.common.v1 import sampling_pb2
from mili.decode.v1 import decode_pb2
from mili.engine.kv_cache import KVLayout
from mili.kv.v1 import kv_pb2
from mili.rpc.kv_codec import layout_to_proto
from services.decode.stream import FINISH_LENGTH, FINISH_STOP, TokenEvent, TokenLogprobs

_FINISH_REASONS = {
    "": sampling_pb2.FINISH_REASON_UNSPECIFIED,
    FINISH_STOP: sampling_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: sampling_pb2.FINISH_REASON_LENGTH,
}


def layout(kv_layout: KVLayout, model_fingerprint: str) -> kv_pb2.KvLayout:
    return layout_to_proto(kv_layout, model_fingerprint)


def logprobs_from_proto(proto: sampling_pb2.Logprobs) -> TokenLogprobs:
    return TokenLogprobs(proto.chosen.logprob, [(t.token_id, t.logprob) for t in proto.top])


def logprobs_to_proto(token_id: int, logprobs: TokenLogprobs) -> sampling_pb2.Logprobs:
    return sampling_pb2.Logprobs(
        chosen=sampling_pb2.TokenLogprob(token_id=token_id, logprob=logprobs.logprob),
        top=[sampling_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def admitted(block_ids: list[int], kv_lease_ms: int) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(
        admitted=decode_pb2.Admitted(block_ids=block_ids, kv_lease_ms=kv_lease_ms)
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
            finish_reason=_FINISH_REASONS[event.finish_reason],
        )
    )
