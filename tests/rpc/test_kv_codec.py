"""KV chunks survive the wire bit for bit, and every kind of damage is DATA_LOSS."""

from __future__ import annotations

import pytest
import torch

from mili.engine.kv_cache import KVLayout
from mili.errors import DataLoss, FailedPrecondition
from mili.rpc import kv_codec

LAYOUT = KVLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=32, dtype="bfloat16")


def _blocks(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    shape = (n, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_round_trip_is_bit_exact(dtype: torch.dtype, n: int) -> None:
    layout = kv_codec.layout_to_proto(LAYOUT._replace(dtype=str(dtype)[6:]), "fp")
    k, v = _blocks(n, dtype)
    chunk = kv_codec.encode_chunk("req-1", 3, 2, list(range(10, 10 + n)), k, v)
    assert len(chunk.data) == 2 * n * kv_codec.block_bytes(layout)
    k2, v2 = kv_codec.decode_chunk(chunk, layout)
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)


def test_corrupt_short_and_misplaced_chunks_are_data_loss() -> None:
    layout = kv_codec.layout_to_proto(LAYOUT, "fp")
    k, v = _blocks(2, torch.bfloat16)
    chunk = kv_codec.encode_chunk("req-9", 7, 1, [4, 5], k, v)

    flipped = type(chunk)()
    flipped.CopyFrom(chunk)
    flipped.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    with pytest.raises(DataLoss, match=r"request 'req-9' chunk 7 \(layer 1\): checksum"):
        kv_codec.decode_chunk(flipped, layout)

    short = type(chunk)()
    short.CopyFrom(chunk)
    short.data = chunk.data[:-2]
    with pytest.raises(DataLoss, match="bytes for 2 blocks"):
        kv_codec.decode_chunk(short, layout)

    misplaced = type(chunk)()
    misplaced.CopyFrom(chunk)
    misplaced.layer = LAYOUT.num_layers
    with pytest.raises(DataLoss, match="layer out of range"):
        kv_codec.decode_chunk(misplaced, layout)


def test_layout_mismatch_names_both_layouts() -> None:
    prefill = kv_codec.layout_to_proto(LAYOUT, "abc")
    decode = kv_codec.layout_to_proto(LAYOUT._replace(block_size=32), "abc")
    kv_codec.check_compatible(prefill, prefill, local_name="a", remote_name="b")
    with pytest.raises(FailedPrecondition) as err:
        kv_codec.check_compatible(decode, prefill, local_name="decode", remote_name="prefill")
    message = str(err.value)
    assert "decode has [block_size=32" in message and "prefill has [block_size=16" in message
