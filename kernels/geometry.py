"""Launch geometry of the sm_90 attention kernels (pure Python, torch-free).

The constants the Mojo sources share with their launcher (CTA threads, rows per prefill CTA,
query heads per decode CTA, shared memory), which kernels/ptx.py asserts at compile time, and the
grids and split plan of the tensor-core prefill and paged decode kernels.

kernels/gpu.py launches from these; tests/kernels/test_geometry.py replays the index math of
kernels/mojo/flash_prefill_gpu.mojo and paged_decode_gpu.mojo on them (which rows each CTA
writes, which keys it reads) so a wrong grid or split plan fails on a machine without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECODE_GROUP_SIZES = (1, 2, 4, 8)  # GC of paged_decode_g<GC>: query heads one CTA serves

# Asserted against the Mojo sources at compile time (kernels/ptx.py's _entry_source).
THREADS = 128  # prefill and decode CTAs
PREFILL_BLOCK_M = {64: 16, 128: 16, 256: 8}  # query rows per prefill CTA: grid.x = ceil(T / BM)
DECODE_HEADS_PER_CTA = 8  # grid.y = KVH * ceil((H / KVH) / 8)
FLASH_PREFILL_BLOCK_M = 64  # rows (token x head of one kv group) per flash_prefill CTA
PAGED_DECODE_MIN_SPLIT_KEYS = 64  # paged_decode never cuts a split shorter than this
_PAD = 8  # flash_prefill's shared-memory row padding (elements)
_PAGED_DECODE_STAGES = 3
_PAGED_DECODE_KEYS_PER_GROUP = 4
_PAGED_DECODE_IDS_WINDOW = 512

# Splits per sequence either automatic plan may pick: this one (paged_decode) and kernels/gpu.py's
# for the fp32 decode kernel. Both feed the same split scratch, and their merges (paged_decode's
# last split, fp32's decode_combine) walk a row's splits one after another, so the cap bounds both.
MAX_DECODE_SPLITS = 64


def dynamic_shared_bytes(kernel: str, head_dim: int) -> int:
    """Dynamic shared memory a launch of `kernel` needs (2-byte dtypes), mirrored from the Mojo
    sources and asserted against them at compile time (kernels/ptx.py's _entry_source)."""
    if kernel.startswith("flash_prefill"):  # Qs [BM][D + 8], 2 x (Ks, Vs) [BN][D + 8], Rb [2][BN]
        block_n = 32 if head_dim == 256 or kernel == "flash_prefill_3cta" else 64
        rows = FLASH_PREFILL_BLOCK_M + 4 * block_n
        return rows * (head_dim + _PAD) * 2 + 2 * block_n * 8
    if kernel.startswith("paged_decode"):  # K/V ring [STAGES][2][TK][D], block ids [512] int32
        keys_per_tile = (THREADS // (head_dim // 8)) * _PAGED_DECODE_KEYS_PER_GROUP
        ring = _PAGED_DECODE_STAGES * 2 * keys_per_tile * head_dim * 2
        return ring + _PAGED_DECODE_IDS_WINDOW * 4
    return 0  # static shared memory only


def flash_prefill_min_ctas(head_dim: int) -> int:
    """CTAs an SM flash_prefill_3cta's launch bounds ask ptxas for (its register cap): 3 where
    3 fit in shared memory (D <= 128), else 2 (D = 256: the default kernel's occupancy)."""
    return 3 if head_dim <= 128 else 2


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


def _split_width(seq_len: int, block_size: int, num_splits: int) -> tuple[int, int]:
    """(blocks of the sequence, blocks per split), as paged_decode cuts them."""
    blocks = math.ceil(seq_len / block_size)
    per = max(math.ceil(blocks / num_splits), math.ceil(PAGED_DECODE_MIN_SPLIT_KEYS / block_size))
    return blocks, per


def decode_split_blocks(seq_len: int, block_size: int, num_splits: int, split: int) -> range:
    """Blocks [lo, hi) split `split` of a sequence of seq_len keys reads (empty: it exits)."""
    blocks, per = _split_width(seq_len, block_size, num_splits)
    lo = split * per
    return range(lo, max(lo, min(blocks, lo + per)))


def decode_live_splits(seq_len: int, block_size: int, num_splits: int) -> int:
    """Splits of a sequence that paged_decode runs, read on the device from its length: the
    last of them to finish merges their parts; with one, it writes the output directly (a
    sequence of 0 keys too: zeros)."""
    blocks, per = _split_width(seq_len, block_size, num_splits)
    return max(1, math.ceil(blocks / per))
