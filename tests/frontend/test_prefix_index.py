"""The frontend's prefix index: leading matches per instance, corrections, expiry, bounds."""

from __future__ import annotations

from services.frontend.prefix_index import PrefixIndex


def test_matches_count_the_leading_keys_each_instance_holds() -> None:
    index = PrefixIndex(block_size=4)
    long = index.keys(list(range(20)))  # 5 keys
    index.record("d1", long[:3], now=0.0)
    index.record("d2", long, now=0.0)
    index.record("d3", long[1:], now=0.0)  # not a prefix: matches nothing
    assert index.matches(long, now=1.0) == {"d1": 3, "d2": 5}
    other = index.keys([9] * 8)
    assert index.matches(other, now=1.0) == {}


def test_entries_expire() -> None:
    index = PrefixIndex(block_size=4, ttl_s=10.0)
    keys = index.keys(list(range(8)))
    index.record("d1", keys, now=0.0)
    index.record("d2", keys[:1], now=5.0)
    assert index.matches(keys, now=9.0) == {"d1": 2, "d2": 1}
    assert index.matches(keys, now=12.0) == {"d2": 1}
    assert index.matches(keys, now=20.0) == {}


def test_expired_keys_leave_the_index_as_new_ones_come() -> None:
    """Found by a leak review: expiry was checked on lookup only, and expired keys stayed
    until the key bound (~74 MB at 200k keys)."""
    index = PrefixIndex(block_size=4, ttl_s=10.0)
    old = index.keys(list(range(40)))  # 10 keys
    index.record("d1", old, now=0.0)
    index.record("d2", old[:2], now=5.0)  # touched later: the two live on
    fresh = index.keys([7] * 12)
    index.record("d1", fresh, now=12.0)
    assert len(index) == 2 + len(fresh)
    assert index.matches(old, now=12.0) == {"d2": 2}
    index.record("d1", fresh, now=16.0)
    assert len(index) == len(fresh)


def test_what_an_instance_reports_lacking_is_forgotten() -> None:
    index = PrefixIndex(block_size=4)
    keys = index.keys(list(range(16)))
    index.record("d1", keys, now=0.0)
    index.record("d2", keys, now=0.0)
    index.forget_from("d1", keys, 1)
    assert index.matches(keys, now=1.0) == {"d1": 1, "d2": 4}
    index.forget("d2")  # went down
    assert index.matches(keys, now=1.0) == {"d1": 1}
    index.forget("d1")
    assert len(index) == 0


def test_the_index_is_bounded_least_recently_touched_first() -> None:
    index = PrefixIndex(block_size=4, max_keys=3)
    a = index.keys(list(range(8)))  # 2 keys
    b = index.keys(list(range(100, 108)))  # 2 keys
    index.record("d1", a, now=0.0)
    index.record("d1", b, now=0.0)
    assert len(index) == 3
    assert index.matches(a, now=1.0) == {}  # a's first key went first
    assert index.matches(b, now=1.0) == {"d1": 2}
