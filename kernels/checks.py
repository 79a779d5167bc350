"""Argument checks shared by the CPU and GPU bindings, run before any pointer crosses into Mojo.

A Mojo kernel trusts the pointers and sizes it is handed: a wrong stride or a short block table is
a crash or silent garbage, never an exception. So everything the kernels assume is checked here,
in Python, with messages that name the argument. Shapes as in `mili.engine.model.attention`:

    q            [T, H, D] (prefill) or [B, H, D] (decode), contiguous, fp32/bf16/fp16
    k/v_cache    [N, S, KVH, D] contiguous, q's dtype and device
    cu_seqlens   [B + 1] int32, start_positions [B] int32, seq_lens [B] int32
    block_tables [B, max_blocks] int32 contiguous
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from kernels.geometry import MAX_DECODE_SPLITS
from kernels.signatures import HEAD_DIMS

# Codes the Mojo entry points dispatch on (kernels/mojo/*.mojo: DTYPE_F32 ...).
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class AttentionDims(NamedTuple):
    """Sizes the kernels are specialised or looped on."""

    dtype_code: int
    num_seqs: int  # B
    num_tokens: int  # T (prefill) or B (decode)
    num_q_heads: int  # H
    num_kv_heads: int  # KVH
    head_dim: int  # D
    num_blocks: int  # N
    block_size: int  # S
    max_blocks: int  # columns of block_tables


def _check_tensor(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (q's device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, {t.stride()})")


def _check_int32(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    _check_tensor(name, t, ndim, device)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")


def _check_q_and_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> AttentionDims:
    """The dims q, the cache and the block table fix; num_seqs is the table's row count."""
    _check_tensor("q", q, 3, q.device)
    if q.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(f"q has dtype {q.dtype}; the Mojo kernels support {supported}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, 4, q.device)
        if cache.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {cache.dtype}, expected q's {q.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape"
        )
    _, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the Mojo kernels {HEAD_DIMS}")
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of cache kv heads ({num_kv_heads})"
        )
    if num_blocks == 0 or block_size == 0:
        raise ValueError(f"empty KV cache {tuple(k_cache.shape)}")
    _check_int32("block_tables", block_tables, 2, q.device)
    num_seqs, max_blocks = block_tables.shape
    return AttentionDims(
        DTYPE_CODES[q.dtype],
        num_seqs,
        q.shape[0],
        num_q_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        max_blocks,
    )


def _check_scale(scale: float) -> None:
    # The kernels scale scores inside their softmax (flash_prefill: exp2(s * scale - m), the
    # row max taken before scaling), which holds for a positive scale only.
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")


def _check_table_rows(dims: AttentionDims, num_seqs: int) -> None:
    if dims.num_seqs != num_seqs:
        raise ValueError(f"block_tables has {dims.num_seqs} rows, expected {num_seqs}")


def check_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_positions: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    scale: float,
    check_values: bool = True,
) -> AttentionDims:
    """Validate a prefill call; `check_values` also reads the index tensors (host sync on GPU)."""
    _check_scale(scale)
    dims = _check_q_and_cache(q, k_cache, v_cache, block_tables)
    _check_int32("cu_seqlens", cu_seqlens, 1, q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("cu_seqlens must hold at least one offset")
    _check_int32("start_positions", start_positions, 1, q.device)
    if start_positions.shape[0] != num_seqs:
        raise ValueError(f"start_positions has {start_positions.shape[0]} entries, want {num_seqs}")
    _check_table_rows(dims, num_seqs)
    if check_values and num_seqs > 0:
        bounds = _host(cu_seqlens)
        starts = _host(start_positions)
        lengths = bounds[1:] - bounds[:-1]
        if bounds[0] != 0 or bounds[-1] != dims.num_tokens or (lengths < 0).any():
            raise ValueError(
                f"cu_seqlens must rise from 0 to q's {dims.num_tokens} tokens, "
                f"got {bounds.tolist()}"
            )
        if (starts < 0).any():
            raise ValueError(f"start_positions must be >= 0, got {starts.tolist()}")
        _check_block_ids(block_tables, starts + lengths, dims)
    return dims


def check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    num_splits: int,
    check_values: bool = True,
) -> AttentionDims:
    """Validate a decode call; `check_values` also reads the index tensors (host sync on GPU).
    `num_splits` 0 is the kernel's choice; past MAX_DECODE_SPLITS its scratch (num_splits x
    B x H x D floats) would be an allocation failure or, sized in overflowing ints, a crash."""
    _check_scale(scale)
    if not 0 <= num_splits <= MAX_DECODE_SPLITS:
        raise ValueError(f"num_splits must be in [0, {MAX_DECODE_SPLITS}], got {num_splits}")
    dims = _check_q_and_cache(q, k_cache, v_cache, block_tables)
    num_seqs = dims.num_tokens  # one query per sequence
    _check_int32("seq_lens", seq_lens, 1, q.device)
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, q has {num_seqs} sequences")
    _check_table_rows(dims, num_seqs)
    if check_values and num_seqs > 0:
        lens = _host(seq_lens)
        if (lens < 1).any():
            raise ValueError(f"seq_lens must be >= 1 (the new token is cached): {lens.tolist()}")
        _check_block_ids(block_tables, lens, dims)
    return dims


def _host(t: torch.Tensor) -> np.ndarray:
    """An int32 index tensor (lengths, offsets: a few per sequence) on the host, widened to
    int64 so that the sums checked here do not wrap (a length near 2^31 once wrapped negative
    and passed, then the kernel read out of bounds). numpy, not torch ops: these checks run per
    layer and per step, and a torch op here would wake torch's OpenMP pool between calls."""
    return t.cpu().numpy().astype(np.int64)


def _check_block_ids(
    block_tables: torch.Tensor, context_lens: np.ndarray, dims: AttentionDims
) -> None:
    """Every block a sequence's context touches must exist in the table and in the cache."""
    num_blocks, block_size, max_blocks = dims.num_blocks, dims.block_size, dims.max_blocks
    needed = (context_lens + block_size - 1) // block_size  # [B] blocks each sequence reads
    most = int(needed.max())
    if most > max_blocks:
        raise ValueError(
            f"a sequence needs {most} blocks of {block_size} tokens, block_tables has {max_blocks}"
        )
    if most == 0:
        return
    table = block_tables.cpu().numpy()[:, :most]  # ids only compared: int32 is exact
    ids = table[np.arange(most)[None, :] < needed[:, None]]
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise ValueError(f"block_tables holds ids outside [0, {num_blocks}): {bad[:4].tolist()}")
