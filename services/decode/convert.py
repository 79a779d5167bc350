"""Proto <-> domain conversions of the decode service (the only place besides the servicers that
imports generated *_pb2 modules)."""

from __future__ import annotations

import grpc

from mili.pb.decode.v1 import decode_pb2
from mili.pb.kv.v1 import kv_pb2
from mili.rpc.kv_layout import check_compatible
from mili.rpc.sampling import finish_reason_to_proto, logprobs_to_proto
from mili.rpc.status import DETAILS_KEY
from services.decode.progress import Header
from services.decode.requests import DecodeRequest
from services.decode.stream import TokenEvent


def transfer_header(header: kv_pb2.TransferHeader, layout: kv_pb2.KvLayout) -> Header:
    """A transfer's header, once its layout is this instance's `layout` (FAILED_PRECONDITION
    naming both otherwise); TransferProgress.start checks the rest."""
    check_compatible(
        layout, header.layout, local_name="this decode instance", remote_name="the prefill instance"
    )
    return Header(header.num_tokens, header.num_chunks, header.transport, header.checksum)


def _admitted(request: DecodeRequest) -> decode_pb2.Admitted:
    return decode_pb2.Admitted(
        prompt_block_ids=request.prompt_block_ids,
        kv_lease_ms=request.lease_ms,
        transfer_token=request.transfer_token,
        num_cached_blocks=request.num_cached_blocks,
    )


def _tokens(event: TokenEvent) -> decode_pb2.Tokens:
    logprobs = []
    if event.logprobs is not None:
        logprobs = [
            logprobs_to_proto(t, lp) for t, lp in zip(event.token_ids, event.logprobs, strict=True)
        ]
    return decode_pb2.Tokens(
        token_ids=event.token_ids,
        logprobs=logprobs,
        finish_reason=finish_reason_to_proto(event.finish_reason),
    )


def admitted(request: DecodeRequest) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(admitted=_admitted(request))


def tokens(event: TokenEvent) -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(tokens=_tokens(event))


# ---- GenerateStream ---------------------------------------------------------------------------


def streamed_admitted(request: DecodeRequest) -> decode_pb2.StreamedEvent:
    return decode_pb2.StreamedEvent(request_id=request.request_id, admitted=_admitted(request))


def streamed_tokens(request_id: str, event: TokenEvent) -> decode_pb2.StreamedEvent:
    return decode_pb2.StreamedEvent(request_id=request_id, tokens=_tokens(event))


def streamed_error(request_id: str, status: grpc.Status) -> decode_pb2.StreamedEvent:
    """The status a Generate call would have ended with (mili.rpc.status.status_of), with the
    google.rpc.Status its trailers carry."""
    details = b""
    for key, value in status.trailing_metadata or ():
        if key == DETAILS_KEY:
            details = bytes(value)
    return decode_pb2.StreamedEvent(
        request_id=request_id,
        error=decode_pb2.RequestError(
            code=status.code.value[0], message=status.details or "", status_details=details
        ),
    )
