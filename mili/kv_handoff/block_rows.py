"""Whole KV blocks of a CPU pool as rows of raw bytes: copies and reads by block id that cost
one numpy call, not one torch call per block (pure tensor helpers; no transport).

    pool [num_blocks, block_size, num_kv_heads, head_dim]  ->  rows [num_blocks, block bytes]

A transfer's blocks are rarely consecutive (the free list hands out whatever was freed last), and
per-block torch calls then cost ~20 us each: 64 per layer of a 512-token prompt made the shm
hand-off Python-bound (docs/benchmarks.md, "KV handoff ... per transport").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def block_rows(pool: torch.Tensor) -> np.ndarray:
    """`pool`'s bytes as [num_blocks, bytes per block] uint8, no copy (contiguous CPU only; a
    uint8 view because numpy has no bf16)."""
    return pool.view(torch.uint8).view(pool.shape[0], -1).numpy()


def fits(dst: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> bool:
    """Whether `write_blocks` can do dst[block_ids] = src: contiguous CPU tensors of one dtype,
    whole blocks, ids in range."""
    n = len(block_ids)
    return (
        dst.device.type == src.device.type == "cpu"
        and src.dtype == dst.dtype
        and tuple(src.shape) == (n, *dst.shape[1:])
        and src.is_contiguous()
        and dst.is_contiguous()
        and (n == 0 or 0 <= min(block_ids) <= max(block_ids) < dst.shape[0])
    )


# Mean run length (consecutive ids) from which `write_blocks` copies run by run.
_MIN_MEAN_RUN = 4


def as_rows(blocks: torch.Tensor, n: int) -> np.ndarray:
    """`n` contiguous blocks [n, ...] as byte rows [n, bytes per block], no copy."""
    return blocks.view(torch.uint8).view(n, -1).numpy()


def write_blocks(dst: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """dst[block_ids] = src ([len(block_ids), ...] blocks, checked by `fits`) on raw byte rows,
    bit-exact; much faster than torch's index_copy_ on bf16, which goes element by element."""
    n = len(block_ids)
    if n:
        copy_rows(block_rows(dst), block_ids, as_rows(src, n))


def copy_rows(rows: np.ndarray, block_ids: Sequence[int], src_rows: np.ndarray) -> None:
    """rows[block_ids] = src_rows, numpy only. Ids mostly in runs (the block pool hands out
    ascending ids): one copy per run, which releases the GIL, so the caller's event loop and
    other threads go on meanwhile. Scattered ids: one fancy-indexed assignment, faster than a
    call per block but holding the GIL."""
    n = len(block_ids)
    if not n:
        return
    runs = block_runs(block_ids)
    if len(runs) * _MIN_MEAN_RUN > n:
        rows[list(block_ids)] = src_rows
        return
    first = 0
    for start, stop in runs:
        np.copyto(rows[start:stop], src_rows[first : first + stop - start])
        first += stop - start


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[7, 8, 9, 2, 3] -> [(7, 10), (2, 4)]: maximal runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs
