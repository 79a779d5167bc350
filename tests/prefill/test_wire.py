"""The sender's one-copy chunk encoder writes exactly what kv_codec.encode_chunk + protobuf do."""

from __future__ import annotations

import pytest
import torch

from mili.kv.v1 import kv_pb2
from mili.rpc.kv_codec import encode_chunk
from services.prefill.wire import chunk_request


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("request_id", "seq", "layer", "block_ids"),
    [
        ("r", 0, 0, [0]),  # zero-valued fields are not written
        ("req-é", 1, 27, [5, 3, 200, 70000]),  # non-ASCII id, multi-byte varints
        ("x" * 300, 130, 128, list(range(40))),  # a length prefix of two bytes
    ],
)
def test_bytes_equal_the_generic_encoding(
    dtype: torch.dtype, request_id: str, seq: int, layer: int, block_ids: list[int]
) -> None:
    g = torch.Generator().manual_seed(seq)
    shape = (len(block_ids), 4, 2, 8)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    message, num_data = chunk_request(request_id, seq, layer, block_ids, k, v)
    chunk = encode_chunk(request_id, seq, layer, block_ids, k, v)
    assert message == kv_pb2.TransferKvRequest(chunk=chunk).SerializeToString()
    assert num_data == len(chunk.data)
    parsed = kv_pb2.TransferKvRequest.FromString(message)
    assert parsed.chunk == chunk


def test_non_contiguous_input_is_encoded_in_c_order() -> None:
    k = torch.arange(2 * 4 * 2 * 8, dtype=torch.float32).reshape(2, 8, 2, 4).transpose(1, 3)
    v = k + 1
    message, _ = chunk_request("r", 1, 1, [0, 1], k, v)
    chunk = encode_chunk("r", 1, 1, [0, 1], k, v)
    assert message == kv_pb2.TransferKvRequest(chunk=chunk).SerializeToString()


def test_shape_mismatch_is_refused() -> None:
    k = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="block ids"):
        chunk_request("r", 0, 0, [0], k, k)
