"""Paged KV block pool: which KV-cache blocks are free, and how many owners each used block has.

Pure bookkeeping (no torch): the tensors that hold K and V live elsewhere and are indexed by the
block ids handed out here. A request's `block_table` is a list of these ids; a block shared by
several requests (prefix reuse) carries one reference per holder and returns to the free list
only when the last holder frees it.

Allocation order is deterministic, so tests (and logs) can name exact ids:

- a fresh pool hands out 0, 1, 2, ... in ascending order;
- freed blocks go to the *back* of the free queue, in the order they reached ref count 0
  (within one `free()` call: the order of the ids given), and are reused after every block that
  was already free. FIFO reuse keeps recently freed blocks untouched longest, which is what a
  prefix cache built on top of this pool wants.

The null block: a pool made with `null_block=True` owns one more id, `null_block_id` =
`num_blocks`, that it never hands out, never frees and never shares. Padded rows of a
fixed-size decode batch (CUDA graphs) point their block table and their new token's slot at it,
so their writes land where no request reads:

    BlockPool(4, null_block=True)       ids 0 1 2 3 | 4
                                        handed out  | null: the KV cache's 5th block
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from mili.arith import ceil_div
from mili.errors import ResourceExhausted


class BlockPoolExhausted(ResourceExhausted):
    """Not enough free blocks for an allocation; nothing was allocated.

    A `ResourceExhausted`, so if it escapes to the transport edge the caller sees
    RESOURCE_EXHAUSTED; schedulers normally catch it and wait for blocks to be freed.
    """

    def __init__(self, requested: int, num_free: int) -> None:
        self.requested = requested
        self.num_free = num_free
        super().__init__(f"requested {requested} KV blocks but only {num_free} are free")


class BlockPool:
    """Hands out KV block ids `0 .. num_blocks-1` and counts references to each.

    Invariant: a block is in the free queue exactly when its ref count is 0.
    """

    def __init__(self, num_blocks: int, *, null_block: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks  # blocks it hands out (the null block not counted)
        # The reserved id (see the module docstring), or None.
        self.null_block_id: int | None = num_blocks if null_block else None
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_ids(self) -> int:
        """Block ids in use by this pool, the null block included: the KV cache's block count."""
        return self.num_blocks + (self.null_block_id is not None)

    @property
    def num_free(self) -> int:
        return len(self._free_ids)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each), all or none; raises BlockPoolExhausted."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"number of blocks to allocate must be an integer >= 0, got {n!r}")
        if n > len(self._free_ids):
            raise BlockPoolExhausted(n, len(self._free_ids))
        block_ids = [self._free_ids.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (allocated) block, e.g. a new request reusing a prefix.

        Raises ValueError, changing nothing, if any id is unknown or free.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot share KV block {block_id}: it is free")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id given; blocks reaching 0 join the back of the free queue.

        An id may appear several times (one reference dropped each time). Raises ValueError,
        changing nothing, if an id is unknown or would drop below 0 references: a double free
        is a bookkeeping bug and must not silently hand one block to two requests later.
        """
        block_ids = list(block_ids)
        for block_id, num_drops in Counter(block_ids).items():
            self._check_id(block_id)
            if num_drops > self._ref_counts[block_id]:
                raise ValueError(
                    f"double free of KV block {block_id}: {self._ref_counts[block_id]} "
                    f"reference(s) held, {num_drops} freed"
                )
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_ids.append(block_id)

    def ref_count(self, block_id: int) -> int:
        """Number of holders of `block_id` (0 when free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def _check_id(self, block_id: int) -> None:
        is_int = isinstance(block_id, int) and not isinstance(block_id, bool)
        if is_int and block_id == self.null_block_id:
            raise ValueError(f"KV block {block_id} is the null block: never allocated or freed")
        if not is_int or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"unknown KV block id {block_id!r} (pool has {self.num_blocks})")

    def __repr__(self) -> str:
        null = "" if self.null_block_id is None else f", null_block_id={self.null_block_id}"
        return f"BlockPool(num_blocks={self.num_blocks}, num_free={self.num_free}{null})"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens at `block_size` tokens per block (ceil division).

    A partly filled last block still takes a whole block::

        num_tokens=10, block_size=4  ->  3 blocks
        | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 -- -- |
          block 0       block 1       block 2 (2 slots free)
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return ceil_div(num_tokens, block_size)


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The most leading blocks of a prompt that may come from a prefix cache: full blocks
    before the one holding its last token, which is always computed (its logits give the
    first output token) and so always sent to decode::

        prompt 8 tokens, block_size 4  ->  1 (block 1 holds the last token)
        prompt 9 tokens, block_size 4  ->  2
    """
    return (num_prompt_tokens - 1) // block_size


def blocks_at_longest(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request holds at its longest: one for every position whose K/V is ever written,
    prompt + max_tokens - 1. A decode instance whose pool is smaller can never finish it.

    The last generated token is streamed but never fed back, so its K/V is never written::

        prompt 5 tokens, max_tokens 4, block_size 4:
        position   0  1  2  3 | 4  5  6  7
        token     p0 p1 p2 p3 |p4 o1 o2 o3   (o4 is sampled from position 7's logits)
        -> 8 positions, 2 blocks
    """
    return blocks_needed(num_prompt_tokens + max_tokens - 1, block_size)


# Output tokens a request's blocks cover at admission; past them its block table grows a block
# at a time as it runs (decode's batch thread), preempting another request when none is free.
# Small enough that a request left with the whole context as its max_tokens does not hold a
# context's worth of blocks it may never use; a request asking for fewer holds exactly its need.
ADMISSION_OUTPUT_TOKENS = 256


def blocks_to_reserve(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request gets at admission: `blocks_at_longest` of its first
    ADMISSION_OUTPUT_TOKENS output tokens. What decode reserves at admission and the frontend
    counts when it routes (with the decode instance's block size): the one rule."""
    return blocks_at_longest(
        num_prompt_tokens, min(max_tokens, ADMISSION_OUTPUT_TOKENS), block_size
    )
