"""Paged KV cache tensors: per-layer K and V blocks, slot arithmetic, whole-block gather/scatter.

Layout (one K and one V tensor per layer, contiguous, views of one allocation):

    k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
    blocks:             [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

    block_table = [7, 2, 9]           (a request's block ids, in position order; block_size 4)
    position:      0 1 2 3 | 4 5 6 7 | 8 9
    block:         7 7 7 7 | 2 2 2 2 | 9 9
    slot = block_table[pos // block_size] * block_size + pos % block_size
         = 28 29 30 31 | 8 9 10 11 | 36 37

Why this layout: one block of one layer is a single contiguous run of
`block_size * num_kv_heads * head_dim` elements, so shipping a request's KV to another process is
one `index_select` of the blocks (`gather_layers`) and bytes on the wire are exactly
`num_blocks x block bytes`; token-major inside a block makes writing one new token a single
contiguous `[num_kv_heads, head_dim]` row at its slot. It is the layout of vLLM's FlashAttention
backend, and it is what the KV transfer ships and the Mojo attention kernels read: changing it
changes the wire format (see `KVLayout`, which both sides publish and compare).

Which blocks are free is not this module's business: `BlockPool` (pure Python) owns that; what
two processes must agree on (`KVLayout`, the dtypes, the default block size) is `kv_layout`'s,
which needs no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mili.engine.kv.kv_layout import DEFAULT_BLOCK_SIZE, DTYPES, KVLayout
from mili.engine.model.config import Qwen3Config

# kv_layout.DTYPES as torch dtypes: each name there is torch's own (torch.bfloat16, ...).
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


def pool_bytes(layout: KVLayout, num_blocks: int, dtype: torch.dtype) -> int:
    """Bytes of a whole pool: every layer's K and V blocks."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize
    return 2 * layout.num_layers * per_layer


def pool_blocks(
    storage: torch.Tensor, layout: KVLayout, num_blocks: int, dtype: torch.dtype
) -> torch.Tensor:
    """`storage` (flat uint8, `pool_bytes` long) as the whole pool, a view:
    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], K (0) then V (1) of each
    layer back to back from offset 0, the order decode's pool has in shared memory or a CUDA
    IPC export (mili/kv_handoff). One view over every layer lets a hand-over gather, copy or
    checksum a prompt's blocks of all layers in one launch."""
    size = pool_bytes(layout, num_blocks, dtype)
    if storage.numel() != size:
        raise ValueError(f"storage holds {storage.numel()} bytes, the pool needs {size}")
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads)
    return storage.view(dtype).view(*shape, layout.head_dim)


def pool_views(
    storage: torch.Tensor, layout: KVLayout, num_blocks: int, dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(k, v) per layer, [num_blocks, block_size, num_kv_heads, head_dim] views of `storage`
    (`pool_blocks`' order)."""
    blocks = pool_blocks(storage, layout, num_blocks, dtype)
    return [b[0] for b in blocks], [b[1] for b in blocks]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bytes_per_block(config: Qwen3Config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id occupies across all layers, K and V together."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = block_size * config.num_key_value_heads * config.head_dim * itemsize
    return 2 * config.num_hidden_layers * per_layer


def slots_for_range(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) of one request: block_table[p // block_size] *
    block_size + p % block_size (a flat [num_blocks * block_size] view of a layer's K or V)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class KVCache:
    """The K and V block tensors of every layer, allocated once at start-up."""

    def __init__(
        self,
        config: Qwen3Config,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
    ) -> None:
        """`storage`: a flat uint8 tensor to carve the pool from (a shared-memory segment, see
        `pool_views` for the order), else the pool is allocated here."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        layout = self.layout_of(config, block_size, dtype)
        if storage is None:
            # Zeros, not empty: a bug that reads an unwritten slot then gives stable wrong
            # numbers instead of NaNs that depend on what the allocator left behind.
            size = pool_bytes(layout, num_blocks, dtype)
            storage = torch.zeros(size, dtype=torch.uint8, device=self.device)
        # else zero-filled by its creator
        self.blocks = pool_blocks(storage.to(self.device), layout, num_blocks, dtype)
        self.k = [b[0] for b in self.blocks]
        self.v = [b[1] for b in self.blocks]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.k[0][0].numel() * self.k[0].element_size()

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype_name(self.dtype),
        )

    @staticmethod
    def layout_of(config: Qwen3Config, block_size: int, dtype: torch.dtype) -> KVLayout:
        """The layout a cache of this model would have (before allocating one)."""
        return KVLayout(
            config.num_hidden_layers,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            dtype_name(dtype),
        )

    def gather_layers(self, start: int, stop: int, index: torch.Tensor) -> torch.Tensor:
        """Copy whole blocks of layers start .. stop-1 out in one launch:
        [stop - start, 2, n, block_size, kv_heads, head_dim] (K then V), contiguous; `index`
        from `block_index`."""
        return self.blocks[start:stop].index_select(2, index)

    def scatter_blocks(
        self,
        layer: int,
        block_ids: Sequence[int] | torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Copy whole blocks of one layer in (what `gather_layers` copies out);
        k/v: [n, block_size, kv_heads, D]."""
        index = self.block_index(block_ids)
        expected = (index.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"scatter_blocks: {name} has shape {tuple(t.shape)}, expected {expected}"
                )
        self.k[layer].index_copy_(0, index, k.to(device=self.device, dtype=self.dtype))
        self.v[layer].index_copy_(0, index, v.to(device=self.device, dtype=self.dtype))

    def block_index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Block ids as an int64 index on the cache's device, checked without a device sync:
        ids from the host (a list, a CPU tensor) are checked there before one non-blocking
        copy from pinned memory; a device tensor is the caller's to have checked (reading
        its min and max back would stall the stream once per layer). Callers that use the
        same ids for every layer make the index once and pass it (a few host calls and a
        copy each time otherwise: most of a prefill step's host time on a GPU)."""
        if isinstance(block_ids, torch.Tensor) and block_ids.device.type != "cpu":
            return block_ids.to(device=self.device, dtype=torch.int64).reshape(-1)
        index = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise IndexError(f"block ids must be in [0, {self.num_blocks}), got {index.tolist()}")
        if self.device.type == "cpu":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)
