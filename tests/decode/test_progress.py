"""TransferProgress: a transfer's bookkeeping with exact ids, no gRPC, no tensors."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from mili.engine.sampling_params import SamplingParams
from mili.errors import DataLoss, FieldViolation, InvalidArgument
from mili.kv_handoff import checksums, kv_transport
from services.decode.progress import Header, TransferProgress
from services.decode.requests import DecodeRequest


class _Chunk(NamedTuple):
    request_id: str
    seq: int
    layer: int
    block_ids: list[int]


def _request(num_cached_blocks: int = 1) -> DecodeRequest:
    """A 13-token prompt holding blocks [9, 4, 5, 6], of which the first `num_cached_blocks`
    came from the prefix cache, plus one block to generate into."""
    return DecodeRequest(
        request_id="r1",
        prompt_token_ids=list(range(13)),
        params=SamplingParams(),
        block_table=[9, 4, 5, 6, 2],
        num_prompt_blocks=4,
        lease_deadline=0.0,
        lease_ms=1000,
        num_cached_blocks=num_cached_blocks,
    )


def _progress(
    num_layers: int = 2, num_chunks: int = 2, num_cached_blocks: int = 1
) -> TransferProgress:
    request = _request(num_cached_blocks)
    return TransferProgress(request, num_layers, num_chunks, kv_transport.GRPC, checksums.CRC32)


def _send(progress: TransferProgress, chunk: _Chunk) -> None:
    progress.check_chunk(chunk)
    progress.record(chunk, num_bytes=100 * len(chunk.block_ids))


def test_a_whole_transfer_completes_and_counts_chunks_and_bytes() -> None:
    progress = _progress()
    _send(progress, _Chunk("r1", 0, 0, [4, 5, 6]))
    _send(progress, _Chunk("r1", 1, 1, [6, 4, 5]))  # any order within a layer
    progress.check_complete()
    assert (progress.num_chunks, progress.num_bytes) == (2, 600)


def test_blocks_of_one_layer_may_come_in_several_chunks() -> None:
    progress = _progress(num_layers=1, num_chunks=2)
    _send(progress, _Chunk("r1", 0, 0, [4]))
    _send(progress, _Chunk("r1", 1, 0, [5, 6]))
    progress.check_complete()


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (_Chunk("r1", 1, 0, [4]), "expected chunk 0"),
        (_Chunk("r2", 0, 0, [4]), "carries request id 'r2'"),
        (_Chunk("r1", 0, 2, [4]), "layer out of range"),
        (_Chunk("r1", 0, 0, [4, 9]), r"block ids \[9\] are not among"),  # cached: not sent
        (_Chunk("r1", 0, 0, [2]), r"block ids \[2\] are not among"),  # a decode block
        (_Chunk("r1", 0, 0, [5, 5]), "layer 0 block 5 sent more than once"),
    ],
)
def test_a_chunk_out_of_place_is_refused(chunk: _Chunk, message: str) -> None:
    progress = _progress()
    with pytest.raises(DataLoss, match=message):
        progress.check_chunk(chunk)
    assert progress.num_chunks == 0


def test_a_block_sent_again_in_a_later_chunk_is_refused() -> None:
    progress = _progress(num_chunks=3)
    _send(progress, _Chunk("r1", 0, 0, [4, 5]))
    _send(progress, _Chunk("r1", 1, 1, [5]))  # the same block, another layer: fine
    with pytest.raises(DataLoss, match="layer 0 block 5 sent more than once"):
        progress.check_chunk(_Chunk("r1", 2, 0, [6, 5]))


def test_chunks_beyond_the_header_are_refused() -> None:
    progress = _progress(num_layers=2, num_chunks=1)
    _send(progress, _Chunk("r1", 0, 0, [4, 5, 6]))
    with pytest.raises(DataLoss, match=r"the header announced 1 chunk$"):
        progress.check_chunk(_Chunk("r1", 1, 1, [4, 5, 6]))


def test_a_commit_before_every_chunk_is_refused() -> None:
    progress = _progress()
    _send(progress, _Chunk("r1", 0, 0, [4, 5, 6]))
    with pytest.raises(DataLoss, match="commit after 1 chunk, the header announced 2"):
        progress.check_complete()


def test_a_commit_with_blocks_never_sent_names_the_first() -> None:
    progress = _progress()
    _send(progress, _Chunk("r1", 0, 0, [4, 5, 6]))
    _send(progress, _Chunk("r1", 1, 1, [6]))
    with pytest.raises(
        DataLoss, match=r"2 \(layer, block\) pairs never sent, e.g. layer 1 block 4"
    ):
        progress.check_complete()


def test_a_fully_cached_prompt_expects_no_blocks() -> None:
    _progress(num_chunks=0, num_cached_blocks=4).check_complete()
    progress = _progress(num_chunks=1, num_cached_blocks=4)
    with pytest.raises(DataLoss, match=r"block ids \[4\] are not among .* receive \[\]"):
        progress.check_chunk(_Chunk("r1", 0, 0, [4]))


# ---- the header --------------------------------------------------------------------------------

_PAIRED = (kv_transport.GRPC, kv_transport.SHM)


def test_a_header_the_request_can_take_starts_the_transfer() -> None:
    header = Header(num_tokens=13, num_chunks=6, transport=kv_transport.SHM, checksum="")
    progress = TransferProgress.start(_request(), header, 2, _PAIRED)
    assert (progress.transport, progress.checksum) == (kv_transport.SHM, checksums.CRC32)
    assert (progress.num_chunks_expected, progress.num_chunks, progress.num_bytes) == (6, 0, 0)
    _send(progress, _Chunk("r1", 0, 1, [4, 5, 6]))  # layers of the 2 the caller named


def test_empty_names_are_the_wire_defaults_grpc_and_crc32() -> None:
    progress = TransferProgress.start(_request(), Header(13, 2, "", ""), 2, [kv_transport.GRPC])
    assert (progress.transport, progress.checksum) == (kv_transport.GRPC, checksums.CRC32)


@pytest.mark.parametrize(
    ("header", "violation"),
    [
        (
            Header(12, 2, "", ""),
            FieldViolation("header.num_tokens", "request 'r1' has 13 prompt tokens (got 12)"),
        ),
        (
            Header(13, 2, kv_transport.CUDA_IPC, ""),
            FieldViolation(
                "header.transport", "this decode instance did not pair with it (got 'cuda-ipc')"
            ),
        ),
        (
            Header(13, 2, "", "md5"),
            FieldViolation("header.checksum", "this decode instance lacks it (got 'md5')"),
        ),
    ],
)
def test_a_header_the_request_cannot_take_is_refused_naming_its_field(
    header: Header, violation: FieldViolation
) -> None:
    with pytest.raises(InvalidArgument) as info:
        TransferProgress.start(_request(), header, 2, _PAIRED)
    assert info.value.violations == [violation]


def test_the_header_counts_all_prompt_tokens_cached_or_not() -> None:
    # num_tokens is the prompt's length, not what is sent: 4 cached blocks change nothing.
    TransferProgress.start(_request(num_cached_blocks=4), Header(13, 0, "", ""), 2, _PAIRED)
