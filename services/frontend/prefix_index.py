"""Which instance probably holds which prompt prefix: the frontend's approximate, expiring index.

Pure bookkeeping for cache-aware routing. Keys are `mili.engine.kv.block_hash` keys over
`block_size`-token chunks of a prompt (the same keys prefill and decode index their caches by,
when their block size is the same), so "instance A holds keys k0..k4" means A computed or
received the KV of the prompt's first 5 chunks. The index learns from what the frontend itself
routes (a prompt's keys once an instance admitted it; decode also keeps the answer's), forgets
what an instance reports it lacks (decode's Admitted.num_cached_blocks, prefill's cached token
count) and whatever it had when the instance went down, and expires entries after `ttl_s`:
an instance evicts without telling anyone, so a stale entry only costs one misrouted request.

Bounded: at most `max_keys` keys, least recently touched dropped first, and expired keys
dropped as new ones come (the least recently touched expire first: one ttl for all).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mili.engine.kv.block_hash import block_hashes
from mili.engine.kv.kv_layout import DEFAULT_BLOCK_SIZE


class PrefixIndex:
    def __init__(
        self,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        ttl_s: float = 600.0,
        max_keys: int = 200_000,
    ) -> None:
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        # key -> {address: expiry (monotonic s)}; order: least recently touched first
        self._holders: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        # Instances that cache no prefix (--no-prefix-cache): never credited with one
        self._uncached: set[str] = set()

    def __len__(self) -> int:
        return len(self._holders)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return block_hashes(token_ids, self.block_size)

    def record(self, address: str, keys: Sequence[bytes], now: float) -> None:
        """`address` holds (or is about to hold) the prefixes `keys` name."""
        if address in self._uncached:
            return
        expiry = now + self.ttl_s
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = {}
            else:
                self._holders.move_to_end(key)
            holders[address] = expiry
        while len(self._holders) > self.max_keys:
            self._holders.popitem(last=False)
        # (checked only on lookup, expired keys stayed until max_keys: ~74 MB at 200k)
        while self._holders:
            oldest = next(iter(self._holders.values()))
            if oldest and max(oldest.values()) > now:
                break
            self._holders.popitem(last=False)

    def matches(self, keys: Sequence[bytes], now: float) -> dict[str, int]:
        """Per address: how many leading `keys` it holds (addresses holding none are absent)."""
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            holders = self._holders.get(key, {})
            live = {a for a, expiry in holders.items() if expiry > now}
            alive = live if alive is None else alive & live
            if not alive:
                break
            for address in alive:
                counts[address] = i + 1
        return counts

    def forget_from(self, address: str, keys: Sequence[bytes], num_held: int) -> None:
        """`address` reported holding only `keys[:num_held]`: it lacks every later one."""
        for key in keys[num_held:]:
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(address, None)
                if not holders:
                    del self._holders[key]

    def set_caching(self, address: str, is_enabled: bool) -> None:
        """Whether `address` caches prefixes at all (its Info says): one that does not is
        never recorded, so it draws no request for a prefix it will never hold."""
        if is_enabled:
            self._uncached.discard(address)
        elif address not in self._uncached:
            self.forget(address)
            self._uncached.add(address)

    def forget(self, address: str) -> None:
        """`address` went down (a restart empties its cache, and may change its flags): drop
        all it held."""
        self._uncached.discard(address)
        for key in list(self._holders):
            holders = self._holders[key]
            if holders.pop(address, None) is not None and not holders:
                del self._holders[key]
