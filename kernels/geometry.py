"""Launch geometry of the tensor-core prefill and paged decode kernels (pure Python, torch-free).

kernels/gpu.py launches from these; tests/kernels/test_geometry.py replays the index math of
kernels/mojo/flash_prefill_gpu.mojo and paged_decode_gpu.mojo on them (which rows each CTA
writes, which keys it reads) so a wrong grid or split plan fails on a machine without a GPU.
The formulas mirror the Mojo sources; kernels/ptx.py asserts the constants they share at compile
time (FLASH_PREFILL_BLOCK_M, PAGED_DECODE_MIN_SPLIT_KEYS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels.ptx import DECODE_GROUP_SIZES, FLASH_PREFILL_BLOCK_M, PAGED_DECODE_MIN_SPLIT_KEYS

MAX_DECODE_SPLITS = 64


@dataclass(frozen=True)
class PrefillTiling:
    """flash_prefill's CTA tiling for one batch: grid (tiles, kv_heads * head_chunks, num_seqs).

    A CTA holds `tokens_per_cta` new tokens x `heads_per_cta` query heads of one kv group as its
    FLASH_PREFILL_BLOCK_M rows (token-major: row r is token r // heads_per_cta)."""

    heads_per_cta: int
    tokens_per_cta: int
    head_chunks: int
    grid: tuple[int, int, int]


def prefill_tiling(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, num_seqs: int
) -> PrefillTiling:
    group = num_q_heads // num_kv_heads
    heads = min(group, FLASH_PREFILL_BLOCK_M)
    tokens = FLASH_PREFILL_BLOCK_M // heads
    chunks = math.ceil(group / heads)
    # num_tokens bounds every sequence's length: tiles past a sequence's end exit at once.
    grid = (max(1, math.ceil(num_tokens / tokens)), num_kv_heads * chunks, num_seqs)
    return PrefillTiling(heads, tokens, chunks, grid)


def decode_group_size(group: int) -> int:
    """GC of the paged_decode_g<GC> kernel for `group` query heads per kv head: the smallest
    compiled size holding the whole group, else the largest (the group spans several CTAs)."""
    for size in DECODE_GROUP_SIZES:
        if size >= group:
            return size
    return DECODE_GROUP_SIZES[-1]


def decode_splits(
    num_seqs: int, num_kv_heads: int, num_q_heads: int, max_context: int, num_sms: int
) -> int:
    """Splits per sequence for paged_decode from shapes only (batch, heads, the block table's
    width = the longest possible context), never from the lengths on the device: the plan is the
    same on every replay of a captured CUDA graph. About two CTAs per SM, each split at least
    PAGED_DECODE_MIN_SPLIT_KEYS keys; the kernel drops splits a shorter sequence does not reach."""
    group = num_q_heads // num_kv_heads
    ctas = num_seqs * num_kv_heads * math.ceil(group / decode_group_size(group))
    want = math.ceil(2 * num_sms / max(ctas, 1))
    useful = max(1, math.ceil(max_context / PAGED_DECODE_MIN_SPLIT_KEYS))
    return max(1, min(want, useful, MAX_DECODE_SPLITS))


def decode_split_blocks(seq_len: int, block_size: int, num_splits: int, split: int) -> range:
    """Blocks [lo, hi) split `split` of a sequence of seq_len keys reads (empty: it exits)."""
    blocks = math.ceil(seq_len / block_size)
    per = max(math.ceil(blocks / num_splits), math.ceil(PAGED_DECODE_MIN_SPLIT_KEYS / block_size))
    lo = split * per
    return range(lo, max(lo, min(blocks, lo + per)))
