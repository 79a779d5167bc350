from __future__ import annotations

import pytest

from mili.engine.kv.block_pool import (
    ADMISSION_OUTPUT_TOKENS,
    BlockPool,
    BlockPoolExhausted,
    blocks_at_longest,
    blocks_needed,
    blocks_to_reserve,
    max_cached_blocks,
)
from mili.errors import ResourceExhausted


def test_fresh_pool_hands_out_ascending_ids() -> None:
    pool = BlockPool(8)
    assert pool.num_blocks == 8
    assert pool.num_free == 8
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(0) == []
    assert pool.num_free == 3


def test_freed_blocks_are_reused_after_older_free_blocks_in_free_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    pool.free([3])
    # 4, 5 were free before, then 2, 0 (order given to free), then 3.
    assert pool.allocate(5) == [4, 5, 2, 0, 3]
    assert pool.num_free == 0


def test_ref_counts_with_shared_blocks() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # request A: [0, 1]
    pool.incref(a[:1])  # request B reuses A's first block as its prefix
    b = a[:1] + pool.allocate(1)  # B: [0, 2]
    assert b == [0, 2]
    assert [pool.ref_count(i) for i in range(4)] == [2, 1, 1, 0]
    pool.free(a)
    assert [pool.ref_count(i) for i in range(4)] == [1, 0, 1, 0]
    assert pool.num_free == 2  # 3, then 1
    pool.free(b)
    assert pool.num_free == 4
    assert pool.allocate(4) == [3, 1, 0, 2]


def test_free_same_id_twice_in_one_call_drops_two_references() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool.incref([0])
    pool.free([0, 0])
    assert pool.ref_count(0) == 0
    assert pool.num_free == 2


def test_exhaustion_raises_and_allocates_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(BlockPoolExhausted) as info:
        pool.allocate(2)
    assert info.value.requested == 2
    assert info.value.num_free == 1
    assert "2" in str(info.value) and "1" in str(info.value)
    assert isinstance(info.value, ResourceExhausted)
    assert pool.num_free == 1
    assert pool.ref_count(3) == 0
    assert pool.allocate(1) == [3]  # the failed call took nothing


def test_counts_restored_after_free() -> None:
    pool = BlockPool(16)
    tables = [pool.allocate(n) for n in (3, 5, 1)]
    pool.incref(tables[0])
    assert pool.num_free == 7
    for table in tables:
        pool.free(table)
    pool.free(tables[0])
    assert pool.num_free == 16
    assert all(pool.ref_count(i) == 0 for i in range(16))


def test_double_free_rejected_without_side_effects() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.free(ids[:1])
    with pytest.raises(ValueError, match="double free of KV block 0"):
        pool.free(ids)  # block 0 is already free; block 1 must stay allocated
    assert pool.ref_count(1) == 1
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free([1, 1])  # one reference held, two dropped
    assert pool.ref_count(1) == 1


@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_unknown_ids_rejected(bad_id: int) -> None:
    pool = BlockPool(4)
    pool.allocate(4)
    for op in (pool.free, pool.incref):
        with pytest.raises(ValueError, match="unknown KV block id"):
            op([0, bad_id])
    with pytest.raises(ValueError, match="unknown KV block id"):
        pool.ref_count(bad_id)
    assert [pool.ref_count(i) for i in range(4)] == [1, 1, 1, 1]


def test_incref_of_free_block_rejected() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(ValueError, match="block 1: it is free"):
        pool.incref([0, 1])
    assert pool.ref_count(0) == 1  # all or nothing


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_invalid_pool_size(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_invalid_allocation_size() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match=">= 0"):
        pool.allocate(-1)
    assert pool.num_free == 4


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (10, 4, 3), (7, 1, 7)],
)
def test_blocks_needed(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_needed(num_tokens, block_size) == expected


def test_blocks_needed_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        blocks_needed(-1, 16)
    with pytest.raises(ValueError, match="block_size"):
        blocks_needed(4, 0)


def test_null_block_is_never_allocated_freed_or_shared() -> None:
    pool = BlockPool(4, null_block=True)
    assert (pool.num_blocks, pool.num_ids, pool.null_block_id, pool.num_free) == (4, 5, 4, 4)
    assert pool.allocate(4) == [0, 1, 2, 3]  # the same ids as a pool without one
    with pytest.raises(BlockPoolExhausted):
        pool.allocate(1)  # the null block is not a spare
    for call in (pool.free, pool.incref):
        with pytest.raises(ValueError, match="null block"):
            call([4])
    with pytest.raises(ValueError, match="null block"):
        pool.free([0, 4])  # nothing changes when one id is bad
    assert pool.ref_count(0) == 1
    pool.free([2, 0, 3, 1])
    assert pool.allocate(4) == [2, 0, 3, 1]  # round trips never bring the null block in
    assert BlockPool(4).null_block_id is None and BlockPool(4).num_ids == 4


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "blocks"),
    [(5, 4, 2), (1, 1, 1), (4, 1, 1), (4, 2, 2), (3, 6, 2), (8, 1, 2), (8, 2, 3)],
)
def test_blocks_at_longest_cover_every_written_position(
    prompt: int, max_tokens: int, blocks: int
) -> None:
    # Positions written: prompt + max_tokens - 1 (the last token is never fed back).
    assert blocks_at_longest(prompt, max_tokens, block_size=4) == blocks
    assert blocks_to_reserve(prompt, max_tokens, block_size=4) == blocks  # few outputs: all


def test_admission_reserves_the_first_outputs_only() -> None:
    first = ADMISSION_OUTPUT_TOKENS
    assert blocks_to_reserve(10, first, block_size=4) == blocks_at_longest(10, first, 4)
    assert blocks_to_reserve(10, 4 * first, block_size=4) == blocks_at_longest(10, first, 4)
    assert blocks_at_longest(10, 4 * first, block_size=4) == (10 + 4 * first - 1 + 3) // 4


@pytest.mark.parametrize(("prompt", "most"), [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2)])
def test_max_cached_blocks_leaves_the_last_tokens_block_to_compute(prompt: int, most: int) -> None:
    assert max_cached_blocks(prompt, block_size=4) == most
