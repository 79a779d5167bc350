"""What two processes must agree on before KV blocks move between them, in pure Python.

No torch here on purpose: the frontend compares layouts and every service's flag parser lists
the dtypes, and neither should load torch (~2 s of CPU and ~190 MiB, see docs/benchmarks.md)
to do it. The tensors themselves are `mili.engine.model.kv_cache`'s business; its name ->
torch.dtype table is built from `DTYPES` below.

One block of one layer, K or V alone (see kv_cache for why this order):

    [block_size, num_kv_heads, head_dim] elements of `dtype`
    block_bytes = block_size * num_kv_heads * head_dim * DTYPE_ITEMSIZE[dtype]

    e.g. Qwen3-0.6B, bf16, block_size 16: 16 * 8 * 128 * 2 B = 32 KiB; K and V of all 28
    layers make 28 * 2 * 32 KiB = 1.75 MiB per block id.
"""

from __future__ import annotations

from typing import NamedTuple

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block; prefill and decode must use the same

# The element types weights and KV may have (--dtype, KvLayout.dtype), named as torch names them
# (`str(torch.bfloat16)` without "torch."), with bytes per element. The one list: flag choices,
# config checks, the wire's block sizes and the torch-side tables all derive from it.
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPES: tuple[str, ...] = tuple(DTYPE_ITEMSIZE)


class KVLayout(NamedTuple):
    """What two processes must agree on before KV blocks can move between them."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # one of DTYPES, e.g. "bfloat16"


def itemsize(dtype: str) -> int:
    """Bytes per element of `dtype`; ValueError naming the supported ones otherwise."""
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {list(DTYPES)}") from None


def block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one block of one layer, K or V alone: [block_size, num_kv_heads, head_dim]."""
    return block_size * num_kv_heads * head_dim * itemsize(dtype)
