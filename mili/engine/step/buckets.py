"""Decode batch sizes that get a CUDA graph, and the one a batch of B sequences runs at.

A CUDA graph replays fixed shapes, so a batch of B sequences runs in the smallest captured size
>= B, the extra rows padded (they point at the null block; see block_pool.py). Sizes are dense
where padding would cost most, relative to B:

    max_batch = 20   ->   1 2 4 8 16 24        B = 3 runs at 4, B = 17 at 24
"""

from __future__ import annotations

from collections.abc import Sequence


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8: ascending, up to the first size >= `max_batch`."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be > 0, got {max_batch}")
    sizes: list[int] = []
    for size in (1, 2, 4, 8):
        sizes.append(size)
        if size >= max_batch:
            return tuple(sizes)
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 8)
    return tuple(sizes)


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int:
    """The smallest of `sizes` (ascending) that holds `num_seqs`; ValueError if none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    raise ValueError(f"a batch of {num_seqs} exceeds the largest graph size {sizes[-1]}")
