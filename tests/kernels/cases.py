"""Random paged-attention cases and their torch reference, shared by the CPU and GPU parity tests.

A case scatters each sequence's K/V into randomly chosen cache blocks (a random permutation, so
block tables are neither sorted nor contiguous), pads block-table rows with a valid id, and keeps
the new tokens' K/V in the cache as the engine does before it calls attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mili.engine.model.attention import AttentionBackend, TorchAttention

if TYPE_CHECKING:
    from kernels.cpu import CpuKernels
    from kernels.gpu import GpuKernels


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D] prefill or [B, H, D] decode
    k: torch.Tensor  # [T, KVH, D] new tokens (prefill only; also in the cache)
    v: torch.Tensor
    k_cache: torch.Tensor  # [N, S, KVH, D]
    v_cache: torch.Tensor
    cu_seqlens: torch.Tensor  # [B + 1] int32 (prefill)
    start_positions: torch.Tensor  # [B] int32 (prefill)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence, new tokens included
    scale: float


def make_case(
    new_lens: list[int],
    starts: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedCase:
    """Sequence i has starts[i] cached tokens and new_lens[i] new ones (decode: new_lens all 1)."""
    gen = torch.Generator().manual_seed(seed)
    totals = [s + n for s, n in zip(starts, new_lens, strict=True)]
    per_seq = [-(-t // block_size) for t in totals]
    max_blocks = max(per_seq, default=0) + 1  # one column of padding beyond the longest
    num_blocks = sum(per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.empty(len(totals), max_blocks, dtype=torch.int32)
    taken = 0
    for i, count in enumerate(per_seq):
        table[i, :count] = perm[taken : taken + count]
        table[i, count:] = perm[-1]  # padding: any valid id
        taken += count

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape), randn(*shape)
    num_tokens = sum(new_lens)
    q = randn(num_tokens, num_q_heads, head_dim)
    k = randn(num_tokens, num_kv_heads, head_dim)
    v = randn(num_tokens, num_kv_heads, head_dim)
    # The engine writes the new tokens' K/V into their slots before attention runs.
    row = 0
    for i, (start, n) in enumerate(zip(starts, new_lens, strict=True)):
        for j in range(n):
            pos = start + j
            block = int(table[i, pos // block_size])
            k_cache[block, pos % block_size] = k[row]
            v_cache[block, pos % block_size] = v[row]
            row += 1
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    return PagedCase(
        q=q.to(device),
        k=k.to(device),
        v=v.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        cu_seqlens=cu.to(device),
        start_positions=torch.tensor(starts, dtype=torch.int32).to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(totals, dtype=torch.int32).to(device),
        scale=head_dim**-0.5,
    )


def run_prefill(kernels: AttentionBackend, case: PagedCase) -> torch.Tensor:
    return kernels.prefill(
        case.q,
        case.k,
        case.v,
        case.cu_seqlens,
        case.start_positions,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        scale=case.scale,
    )


def run_decode(
    kernels: CpuKernels | GpuKernels, case: PagedCase, num_splits: int = 0
) -> torch.Tensor:
    return kernels.decode(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        scale=case.scale,
        num_splits=num_splits,
    )


def poison_unread_slots(case: PagedCase) -> None:
    """Fill every cache slot no sequence attends to with NaN (K) and inf (V), in place: blocks
    no table lists and the tail past each sequence's context in its last block (what a freed
    block holds is whatever its last owner wrote)."""
    num_blocks, block_size = case.k_cache.shape[:2]
    read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables, lens = case.block_tables.cpu(), case.seq_lens.cpu()
    for i, context in enumerate(lens.tolist()):
        for pos in range(context):
            read[int(tables[i, pos // block_size]), pos % block_size] = True
    unread = (~read).to(case.k_cache.device)
    case.k_cache[unread] = float("nan")
    case.v_cache[unread] = float("inf")


def reference_prefill(case: PagedCase) -> torch.Tensor:
    """TorchAttention in fp64 (the kernels accumulate in fp32; fp64 makes the reference exact)."""
    c = _as_f64(case)
    return TorchAttention().prefill(
        c.q,
        c.k,
        c.v,
        c.cu_seqlens,
        c.start_positions,
        c.k_cache,
        c.v_cache,
        c.block_tables,
        scale=c.scale,
    )


def reference_decode(case: PagedCase) -> torch.Tensor:
    c = _as_f64(case)
    return TorchAttention().decode(
        c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, scale=c.scale
    )


def _as_f64(case: PagedCase) -> PagedCase:
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.cpu().double()

    def i(t: torch.Tensor) -> torch.Tensor:
        return t.cpu()

    return PagedCase(
        q=f(case.q),
        k=f(case.k),
        v=f(case.v),
        k_cache=f(case.k_cache),
        v_cache=f(case.v_cache),
        cu_seqlens=i(case.cu_seqlens),
        start_positions=i(case.start_positions),
        block_tables=i(case.block_tables),
        seq_lens=i(case.seq_lens),
        scale=case.scale,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 within 1e-5; bf16/fp16 within 2e-2 relative (of the output's magnitude)."""
    actual = actual.detach().cpu().double()
    expected = expected.double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all(), "kernel output has non-finite values"
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        err = (actual - expected).abs().max().item()
        ref = expected.abs().max().item()
        assert err <= 2e-2 * max(ref, 1e-6), f"max abs error {err:.3g} vs max |ref| {ref:.3g}"
