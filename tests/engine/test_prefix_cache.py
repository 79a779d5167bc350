"""Prefix cache bookkeeping: exact block ids through insert, match, free and LRU eviction."""

from __future__ import annotations

import pytest

from mili.engine.kv.block_hash import block_hashes
from mili.engine.kv.block_pool import BlockPool, BlockPoolExhausted
from mili.engine.kv.prefix_cache import PrefixCache

B = 4  # block size


def make(num_blocks: int = 8, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockPool(num_blocks), B, enabled=enabled)


def num_cached_prefix_blocks(cache: PrefixCache, token_ids: list[int]) -> int:
    """How many leading full blocks of `token_ids` are cached. Read from the index itself:
    `match` would take references and move the blocks in the LRU order under test."""
    keys = cache.keys(token_ids)
    return next((i for i, key in enumerate(keys) if key not in cache._block_of_key), len(keys))


def test_keys_chain_the_whole_prefix_and_skip_the_partial_block() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], B)
    assert len(a) == 2
    # same second block after a different first block: a different key
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], B)
    assert a[0] != b[0] and a[1] != b[1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], B) == a
    assert block_hashes([1, 2, 3], B) == []
    assert block_hashes(list(range(8)), 8) != block_hashes(list(range(8)), 4)[:1]


def test_insert_then_match_returns_the_exact_blocks_with_a_reference_each() -> None:
    cache = make()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    table = cache.allocate(3)
    assert table == [0, 1, 2]
    assert cache.insert(prompt, table) == 2  # the partial block 2 is not cached
    assert cache.num_cached == 2
    assert [cache.pool.ref_count(b) for b in table] == [2, 2, 1]

    # same first block, different second one: one block matched
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 9]) == [0]
    assert cache.pool.ref_count(0) == 3
    assert cache.match(prompt) == [0, 1]
    assert cache.match(list(range(12))) == [0, 1]  # a longer prompt with the same prefix
    assert cache.match([5, 5, 5, 5]) == []
    assert cache.stats.hit_tokens == (1 + 2 + 2) * B
    assert num_cached_prefix_blocks(cache, prompt) == 2


def test_max_blocks_leaves_the_last_token_to_compute() -> None:
    cache = make()
    prompt = list(range(8))  # exactly two full blocks
    cache.insert(prompt, cache.allocate(2))
    assert cache.match(prompt, max_blocks=(len(prompt) - 1) // B) == [0]


def test_freed_cached_blocks_are_evicted_lru_tail_first_only_when_the_pool_is_short() -> None:
    cache = make(num_blocks=6)
    first = list(range(8))
    second = list(range(100, 108))
    t1 = cache.allocate(2)  # [0, 1]
    t2 = cache.allocate(2)  # [2, 3]
    cache.insert(first, t1)
    cache.insert(second, t2)
    cache.free(t1)
    cache.free(t2)
    assert cache.pool.num_free == 2 and cache.num_evictable == 4 and cache.num_available == 6

    # room without eviction: the free blocks come first and nothing is evicted
    assert cache.allocate(2) == [4, 5]
    assert cache.num_cached == 4 and cache.stats.evicted_blocks == 0

    # two more: the least recently freed chain goes, its tail before its head
    assert cache.allocate(1) == [1]
    assert num_cached_prefix_blocks(cache, first) == 1
    assert cache.allocate(1) == [0]
    assert num_cached_prefix_blocks(cache, first) == 0
    assert num_cached_prefix_blocks(cache, second) == 2
    assert cache.stats.evicted_blocks == 2


def test_a_block_referenced_by_a_request_is_never_evicted() -> None:
    cache = make(num_blocks=4)
    prompt = list(range(8))
    table = cache.allocate(2)
    cache.insert(prompt, table)
    cache.free(table)
    held = cache.match(prompt)  # a running request holds both again
    assert held == [0, 1] and cache.num_evictable == 0
    assert cache.allocate(2) == [2, 3]
    with pytest.raises(BlockPoolExhausted):
        cache.allocate(1)
    assert cache.num_cached == 2 and [cache.pool.ref_count(b) for b in held] == [2, 2]


def test_a_hit_makes_the_block_most_recently_used() -> None:
    cache = make(num_blocks=3)
    a, b = [1] * 4, [2] * 4
    ta, tb = cache.allocate(1), cache.allocate(1)  # [0], [1]
    cache.insert(a, ta)
    cache.insert(b, tb)
    cache.free(ta)
    cache.free(tb)
    cache.free(cache.match(a))  # a used again: b is now least recently used
    assert cache.allocate(2) == [2, 1]
    assert num_cached_prefix_blocks(cache, a) == 1
    assert num_cached_prefix_blocks(cache, b) == 0


def test_exhaustion_evicts_nothing() -> None:
    cache = make(num_blocks=3)
    t = cache.allocate(2)
    cache.insert(list(range(8)), t)
    cache.free(t)
    with pytest.raises(BlockPoolExhausted):
        cache.allocate(4)
    assert cache.num_cached == 2 and cache.pool.num_free == 1


def test_duplicate_prefix_keeps_the_first_copy_and_frees_the_second() -> None:
    cache = make()
    prompt = list(range(8))
    t1, t2 = cache.allocate(2), cache.allocate(2)  # computed twice concurrently
    assert cache.insert(prompt, t1) == 2
    assert cache.insert(prompt, t2) == 0
    cache.free(t2)
    assert cache.pool.num_free == 8 - 2 - 2 + 2
    cache.free(t1)
    assert cache.match(prompt) == t1


def test_clear_returns_every_unreferenced_block_to_the_pool() -> None:
    cache = make()
    t = cache.allocate(3)
    cache.insert(list(range(12)), t)
    held = cache.match(list(range(4)))
    cache.free(t)
    assert cache.clear() == 2
    assert cache.num_cached == 1 and cache.pool.num_free == 7
    cache.free(held)
    assert cache.clear() == 1 and cache.pool.num_free == 8


def test_disabled_cache_is_the_plain_pool() -> None:
    cache = make(enabled=False)
    t = cache.allocate(2)
    assert cache.insert(list(range(8)), t) == 0
    cache.free(t)
    assert cache.match(list(range(8))) == [] and cache.pool.num_free == 8
