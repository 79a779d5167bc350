"""KV blocks on the wire: layout messages, layout checks, and KvChunk encode/decode with CRC-32.

One chunk carries the K and V of some whole blocks of one layer (see mili/kv/v1/kv.proto):

    data = bytes(K) + bytes(V), each a C-order [n_blocks, block_size, num_kv_heads, head_dim]
           tensor of the layout's dtype (little-endian, as torch stores it on x86/ARM and CUDA)
    crc32 = zlib.crc32(data)

Both sides publish a KvLayout; `check_compatible` refuses a pair that differs in any field,
naming both layouts, so a mismatch is a FAILED_PRECONDITION at set-up, never garbage tokens.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence

import torch

from mili.engine.kv_cache import KVLayout
from mili.errors import DataLoss, FailedPrecondition
from mili.kv.v1 import kv_pb2

BLOCK_ORDER = "block,slot,head,dim"  # [num_blocks, block_size, num_kv_heads, head_dim]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layout_to_proto(layout: KVLayout, model_fingerprint: str) -> kv_pb2.KvLayout:
    return kv_pb2.KvLayout(
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_order=BLOCK_ORDER,
        model_fingerprint=model_fingerprint,
    )


def describe(layout: kv_pb2.KvLayout) -> str:
    return (
        f"block_size={layout.block_size} num_layers={layout.num_layers} "
        f"num_kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} dtype={layout.dtype} "
        f"block_order={layout.block_order} model={layout.model_fingerprint}"
    )


def check_compatible(
    local: kv_pb2.KvLayout, remote: kv_pb2.KvLayout, *, local_name: str, remote_name: str
) -> None:
    """Raise FailedPrecondition naming both layouts unless they are equal in every field."""
    if local != remote:
        raise FailedPrecondition(
            f"KV layouts differ, so KV blocks cannot move between {local_name} and "
            f"{remote_name}: {local_name} has [{describe(local)}], {remote_name} has "
            f"[{describe(remote)}]"
        )


def block_bytes(layout: kv_pb2.KvLayout) -> int:
    """Bytes of one block of one layer, K or V alone."""
    itemsize = torch.empty((), dtype=torch_dtype(layout)).element_size()
    return layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize


def torch_dtype(layout: kv_pb2.KvLayout) -> torch.dtype:
    try:
        return _DTYPES[layout.dtype]
    except KeyError:
        raise FailedPrecondition(f"unsupported KV dtype {layout.dtype!r}") from None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # uint8 view of the raw elements: works for bf16, which numpy cannot represent.
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def encode_chunk(
    request_id: str,
    seq: int,
    layer: int,
    block_ids: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
) -> kv_pb2.KvChunk:
    """k, v: [len(block_ids), block_size, num_kv_heads, head_dim] of the cache's dtype."""
    if k.shape != v.shape or k.shape[0] != len(block_ids):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} vs {len(block_ids)} block ids")
    data = _tensor_bytes(k) + _tensor_bytes(v)
    return kv_pb2.KvChunk(
        request_id=request_id,
        seq=seq,
        layer=layer,
        block_ids=block_ids,
        data=data,
        crc32=zlib.crc32(data),
    )


def decode_chunk(
    chunk: kv_pb2.KvChunk, layout: kv_pb2.KvLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a chunk against `layout`; return (k, v), each [n, block_size, kv_heads, D].

    Raises DataLoss naming the request, chunk and layer when the bytes are corrupt or short.
    """
    where = f"request {chunk.request_id!r} chunk {chunk.seq} (layer {chunk.layer})"
    if chunk.layer >= layout.num_layers:
        raise DataLoss(f"{where}: layer out of range (model has {layout.num_layers})")
    n = len(chunk.block_ids)
    data = chunk.data  # each read of a bytes field copies it: read the megabytes once
    expected = 2 * n * block_bytes(layout)
    if len(data) != expected:
        raise DataLoss(f"{where}: {len(data)} bytes for {n} blocks, expected {expected}")
    if zlib.crc32(data) != chunk.crc32:
        raise DataLoss(f"{where}: checksum mismatch (data corrupted in transit)")
    shape = (n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if n == 0:
        empty = torch.empty(shape, dtype=torch_dtype(layout))
        return empty, empty.clone()
    with warnings.catch_warnings():  # bytes are read-only; we only read them (then copy)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    values = flat.view(torch_dtype(layout))
    half = values.numel() // 2
    return values[:half].view(shape), values[half:].view(shape)
