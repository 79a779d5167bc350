"""Prefix cache: full KV blocks indexed by the token ids they hold, shared by reference count.

Pure bookkeeping (no torch) on top of one `BlockPool`. Why chained block hashes rather than a
radix tree: a block's key is a 16-byte digest of (parent key, the block's token ids), so a key
names the whole prefix up to and including that block. That makes three things cheap that a
tree makes awkward: the frontend can compute the same keys from token ids alone to route by
prefix (`mili.engine.kv.block_hash` is torch-free and has no per-instance state), two instances
can say "I hold blocks k0..kn" with a list of keys, and lookup is one dict probe per block.
Only *full* blocks are cached: a partial last block is still being written by its request.

    prompt (block_size 4): 10 11 12 13 | 14 15 16 17 | 18 19
    keys:                  k0 = H(root, 10..13), k1 = H(k0, 14..17)      (18 19: not cached)

Ownership. The cache holds one reference of its own on every cached block; requests hold the
others. A cached block whose only reference is the cache's is *evictable*: it stays in the
index (a later prompt may reuse it) until an allocation needs the room, then the least
recently used evictable block goes first. A block referenced by a request is never evicted.

    pool refs:  request A ─┐
                cache ─────┴─> block 7 (k0)   ref 2: in use, not evictable
                cache ───────> block 9 (k1)   ref 1: evictable (LRU order kept)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mili.engine.kv.block_hash import block_hashes
from mili.engine.kv.block_pool import BlockPool, BlockPoolExhausted


@dataclass
class PrefixCacheStats:
    """Counters since start; exported as metrics and by Info."""

    query_tokens: int = 0  # tokens of the prompts looked up
    hit_tokens: int = 0  # tokens served from cached blocks
    evicted_blocks: int = 0


class PrefixCacheReading(NamedTuple):
    """One consistent read of a cache's size and counters (taken under its owner's lock)."""

    cached_blocks: int
    query_tokens: int
    hit_tokens: int
    evicted_blocks: int
    enabled: bool = True


class PrefixCache:
    """Longest-prefix lookup and LRU eviction over full, hashed blocks of one pool.

    Not thread-safe: its owner (scheduler or request table) calls it under its own lock.
    With `enabled=False` nothing is ever cached and `allocate`/`free` are the pool's own.
    """

    def __init__(self, pool: BlockPool, block_size: int, *, enabled: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.stats = PrefixCacheStats()
        self._block_of_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        # Evictable blocks (only the cache's reference left), least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached(self) -> int:
        return len(self._block_of_key)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def reading(self) -> PrefixCacheReading:
        s = self.stats
        return PrefixCacheReading(
            self.num_cached, s.query_tokens, s.hit_tokens, s.evicted_blocks, self.enabled
        )

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.pool.num_free + len(self._evictable)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The keys of `token_ids`' full blocks (for an owner that looks a prompt up often)."""
        return block_hashes(token_ids, self.block_size)

    def record(self, num_query_tokens: int, num_hit_blocks: int) -> None:
        """Count one lookup of `num_query_tokens` tokens that reused `num_hit_blocks` blocks."""
        self.stats.query_tokens += num_query_tokens
        self.stats.hit_tokens += num_hit_blocks * self.block_size

    def match(
        self, token_ids: Sequence[int], *, max_blocks: int | None = None, record: bool = True
    ) -> list[int]:
        """Block ids holding the longest cached full-block prefix of `token_ids`, in order.

        The caller gets one reference on each returned block (free them with `free`). At most
        `max_blocks` are matched: a prefill must compute at least the prompt's last token to
        get its logits, so it asks for at most block_pool.max_cached_blocks. `record=False`
        leaves the counters to the caller (`record`, once it keeps the blocks).
        """
        matched = self.match_keys(self.keys(token_ids), max_blocks=max_blocks)
        if record:
            self.record(len(token_ids), len(matched))
        return matched

    def match_keys(self, keys: Sequence[bytes], *, max_blocks: int | None = None) -> list[int]:
        """`match` on keys already computed (`keys`); counts nothing."""
        matched = self._cached_blocks(keys, max_blocks)
        self._acquire(matched)
        return matched

    def is_cached(self, key: bytes) -> bool:
        """Whether a block of `key` is cached now (a match may still stop before it)."""
        return self.enabled and key in self._block_of_key

    def num_matching(self, keys: Sequence[bytes], *, max_blocks: int | None = None) -> int:
        """How many blocks `match_keys` would return now; takes no reference, counts nothing."""
        return len(self._cached_blocks(keys, max_blocks))

    def _cached_blocks(self, keys: Sequence[bytes], max_blocks: int | None) -> list[int]:
        if not self.enabled:
            return []
        matched: list[int] = []
        for key in keys:
            if max_blocks is not None and len(matched) >= max_blocks:
                break
            block_id = self._block_of_key.get(key)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks (one reference each), evicting LRU cached blocks if the pool is short.

        All or none: raises BlockPoolExhausted, evicting nothing, when even eviction would not
        make room.
        """
        short = n - self.pool.num_free
        if short > 0:
            if short > len(self._evictable):
                raise BlockPoolExhausted(n, self.num_available)
            self._evict(short)
        return self.pool.allocate(n)

    def insert(self, token_ids: Sequence[int], block_table: Sequence[int]) -> int:
        """Index the full blocks of `token_ids`, held in `block_table[i]` for block i.

        Call when those blocks' KV is complete (computed or landed). A block whose prefix is
        already cached under another id is left alone (the request keeps its own copy; the
        index keeps the first). Returns how many blocks were newly cached.
        """
        return self.insert_keys(self.keys(token_ids), block_table)

    def insert_keys(self, keys: Sequence[bytes], block_table: Sequence[int]) -> int:
        """`insert` with the blocks' keys already computed."""
        if not self.enabled:
            return 0
        if len(block_table) < len(keys):
            raise ValueError(
                f"{len(keys)} full blocks of tokens but a block table of {len(block_table)}"
            )
        added = 0
        for key, block_id in zip(keys, block_table[: len(keys)], strict=True):
            if key in self._block_of_key or block_id in self._key_of_block:
                continue
            self.pool.incref([block_id])  # the cache's own reference
            self._block_of_key[key] = block_id
            self._key_of_block[block_id] = key
            added += 1
        return added

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per id; cached blocks left with only the cache's become evictable."""
        self.pool.free(block_ids)
        # Last block first, so a chain's tail is evicted before its head: evicting a head
        # would leave its descendants unreachable by `match` while they still take room.
        for block_id in reversed(block_ids):
            if block_id in self._key_of_block and self.pool.ref_count(block_id) == 1:
                self._evictable[block_id] = None
                self._evictable.move_to_end(block_id)

    def clear(self) -> int:
        """Evict every evictable block (e.g. a layout change); returns how many went."""
        n = len(self._evictable)
        self._evict(n)
        return n

    def _acquire(self, block_ids: list[int]) -> None:
        self.pool.incref(block_ids)
        for block_id in block_ids:
            self._evictable.pop(block_id, None)

    def _evict(self, n: int) -> None:
        for _ in range(n):
            block_id, _ = self._evictable.popitem(last=False)
            key = self._key_of_block.pop(block_id)
            del self._block_of_key[key]
            self.pool.free([block_id])
            self.stats.evicted_blocks += 1

    def __repr__(self) -> str:
        return (
            f"PrefixCache(cached={self.num_cached}, evictable={self.num_evictable}, "
            f"free={self.pool.num_free}, enabled={self.enabled})"
        )
