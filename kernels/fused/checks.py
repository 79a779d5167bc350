"""Argument checks of the fused kernels, run before any pointer crosses into Mojo.

Like kernels/checks.py for attention: the kernels trust pointers and sizes, so every shape,
dtype, device and contiguity they assume is checked here, with messages naming the argument.
Shapes as in mili/engine/model/fused_ops.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.checks import DTYPE_CODES
from kernels.fused.ptx import ROPE_HEAD_DIMS


class RopeDims(NamedTuple):
    dtype_code: int
    num_tokens: int  # T
    num_q_heads: int  # H
    num_kv_heads: int  # KVH
    head_dim: int  # D
    num_positions: int  # rows of the cos/sin table
    num_slots: int  # N * S


def _check(name: str, t: torch.Tensor, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, {t.stride()})")


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")


def dtype_code(name: str, t: torch.Tensor) -> int:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise ValueError(
            f"{name} has dtype {t.dtype}; the fused kernels support {supported}"
        ) from None


def check_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> int:
    """x (and residual): [rows, dim], weight: [dim], one dtype, contiguous. Returns the code."""
    _check("x", x, 2, x.device)
    code = dtype_code("x", x)
    if residual is not None:
        _check("residual", residual, 2, x.device)
        _check_dtype("residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    _check("weight", weight, 1, x.device)
    _check_dtype("weight", weight, x.dtype)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} entries, x rows have {x.shape[1]}")
    return code


def check_silu_mul(gate_up: torch.Tensor) -> int:
    _check("gate_up", gate_up, 2, gate_up.device)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up's width {gate_up.shape[1]} is not gate | up (odd)")
    return dtype_code("gate_up", gate_up)


def check_grouped_gemm(
    rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """rows [R, K], weight [E, N, K] (one dtype), offsets [E] int32 non-decreasing from >= 0
    to R, all contiguous. Returns the dtype code and the experts with rows (int32, ascending)."""
    _check("rows", rows, 2, rows.device)
    code = dtype_code("rows", rows)
    _check("weight", weight, 3, rows.device)
    _check_dtype("weight", weight, rows.dtype)
    _check("offsets", offsets, 1, rows.device)
    _check_dtype("offsets", offsets, torch.int32)
    num_experts, _, k = weight.shape
    if k != rows.shape[1]:
        raise ValueError(f"weight rows have {k} entries, rows have {rows.shape[1]}")
    if offsets.shape[0] != num_experts:
        raise ValueError(f"offsets has {offsets.shape[0]} entries for {num_experts} experts")
    ends = offsets.tolist()  # E <= 512 ints: a few us, the kernel's only host work
    starts = [0, *ends[:-1]]
    last = ends[-1] if ends else 0
    if last != rows.shape[0] or any(end < start for start, end in zip(starts, ends, strict=True)):
        raise ValueError(f"offsets must rise from >= 0 to the {rows.shape[0]} rows, got {ends}")
    active = [e for e, (start, end) in enumerate(zip(starts, ends, strict=True)) if end > start]
    return code, torch.tensor(active, dtype=torch.int32)


def check_qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    check_values: bool = True,
) -> RopeDims:
    """Validate a qk_norm_rope_kv call; `check_values` also reads positions and slot_mapping
    (a host sync on a GPU) to keep every table row and cache slot in range."""
    device = qkv.device
    _check("qkv", qkv, 2, device)
    code = dtype_code("qkv", qkv)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, cache, 4, device)
        _check_dtype(name, cache, qkv.dtype)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in ROPE_HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} is not supported by the fused kernels {ROPE_HEAD_DIMS}"
        )
    num_tokens, width = qkv.shape
    num_q_heads = width // head_dim - 2 * num_kv_heads
    if width % head_dim or num_q_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"qkv rows of {width} are not q | k | v heads of {head_dim} "
            f"with {num_kv_heads} kv heads"
        )
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        _check(name, weight, 1, device)
        _check_dtype(name, weight, qkv.dtype)
        if weight.shape[0] != head_dim:
            raise ValueError(f"{name} has {weight.shape[0]} entries, head_dim is {head_dim}")
    _check("cos_sin", cos_sin, 2, device)
    _check_dtype("cos_sin", cos_sin, torch.float32)
    if cos_sin.shape[1] != head_dim:
        raise ValueError(f"cos_sin rows have {cos_sin.shape[1]} entries, head_dim is {head_dim}")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        _check(name, index, 1, device)
        _check_dtype(name, index, torch.int64)
        if index.shape[0] != num_tokens:
            raise ValueError(f"{name} has {index.shape[0]} entries, qkv has {num_tokens} tokens")
    dims = RopeDims(
        code,
        num_tokens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        cos_sin.shape[0],
        num_blocks * block_size,
    )
    if check_values and num_tokens:
        _check_range("positions", positions, dims.num_positions)
        _check_range("slot_mapping", slot_mapping, dims.num_slots)
    return dims


# Up to this many entries (a decode step's), a Python list is the cheapest way to their bounds.
_LIST_ENTRIES = 256


def _check_range(name: str, index: torch.Tensor, end: int) -> None:
    # No torch ops: per layer and step, a torch op would wake torch's thread pool.
    if index.shape[0] <= _LIST_ENTRIES:
        values = index.tolist()
        low, high = min(values), max(values)
    else:
        array = index.cpu().numpy()
        low, high = int(array.min()), int(array.max())
    if low < 0 or high >= end:
        raise ValueError(f"{name} must lie in [0, {end}), got values in [{low}, {high}]")
