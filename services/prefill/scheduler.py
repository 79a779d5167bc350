"""Which prompt chunks go into the next forward: a FIFO queue, a token budget, fixed chunk plans.

Pure bookkeeping (no torch, no threads): the worker calls it under its lock.

Chunk plan. A prompt's chunks are fixed when it arrives, from its length alone, so the KV
transfer's header can announce the exact chunk count before any compute:

    chunk_tokens C = max_batch_tokens rounded down to whole blocks   (block_size 4, C = 8)
    prompt of 19 tokens:  [0, 8) [8, 16) [16, 19)
    blocks:               | b0 b1 | b2 b3 | b4 (partial) |

Every chunk but the last ends on a block boundary, so after each chunk its blocks are complete
and can be shipped; the last chunk also ships the final partial block.

A step (one forward) is built from:
  1. running prompts (already admitted, more chunks to go), oldest first, while their next chunk
     fits what is left of the budget;
  2. waiting prompts, FIFO: a prompt whose first chunk does not fit the budget left is skipped
     (a later, shorter one may fill the gap: first fit by tokens, but only one computed whole
     in this step, so the skipped prompt gets the budget once the running ones are done), and
     one that cannot get its blocks stops admission (FIFO by memory, so a long prompt is not
     starved by short ones).
A prompt gets all of its blocks when admitted and keeps them until `remove` (the transfer was
acknowledged, failed or cancelled): a running prompt can never deadlock waiting for blocks.

Short prompts first, once. A long prompt's chunk takes the whole budget, so in that order a
short prompt arriving behind it would wait for every one of its chunks (a 16k-token prompt at
the default budget: 8 forwards) before its first token. So when a waiting prompt computed whole
in one step (one of one chunk, or a longer one whose cached prefix leaves only its last chunk
to compute: a chat's next turn) does not fit beside the running prompts' next chunks, the step
takes the order 2, 1 instead, admitting only prompts computed whole in it (never a second long
one); running chunks fill what is left. A step that left a running chunk out is followed by
one in the order 1, 2: a long prompt computes at least every other step, and a short one
(given room in the budget, behind earlier short ones, and blocks) waits for at most the step in
flight and one more.

    C = 16, a long prompt of 64 tokens, a short one of 7 arriving during step 1:
    1, 2 always:  | long [0,16) | long [16,32) | long [32,48) | long [48,64) | short [0,7) |
    2, 1 once:    | long [0,16) | short [0,7)  | long [16,32) | long [32,48) | long [48,64) |

Steps never pass the budget either way, and a lone prompt's steps are those of its plan.

Prefix cache. A prompt added with its token ids reuses the longest cached run of full blocks
(`PrefixCache`, at most all but the last token, whose logits the first token needs). The chunk
plan does not change: chunks wholly inside the cached prefix are *ship-only* (nothing to
compute, their blocks still go to decode in the admitting step), and the chunk where the cached
prefix ends computes only from there. Every chunk's computed full blocks join the cache when the
step ends, so a later prompt with the same prefix finds them.

    C = 8, block_size 4, 12 cached tokens, prompt of 19:
    fixed chunks  [0, 8)        [8, 16)              [16, 19)
    this prompt   ship-only     compute [12, 16)     compute [16, 19)
                  blocks b0 b1  ships b2 b3          ships b4
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mili.arith import ceil_div
from mili.engine.kv.block_pool import BlockPool, blocks_needed, max_cached_blocks
from mili.engine.kv.prefix_cache import PrefixCache
from mili.errors import InvalidArgument, ResourceExhausted, count_of
from mili.plural import plural


class ScheduledChunk(NamedTuple):
    """One fixed chunk [ship_start, end) of one request; positions [start, end) computed now.

    `start == ship_start` unless a cached prefix covers the chunk's beginning; `start == end`
    for a ship-only chunk (wholly cached: nothing to compute, its blocks are shipped).
    """

    request_id: str
    start: int
    end: int
    num_tokens: int  # the whole prompt's length
    block_table: list[int]  # this instance's block ids of the whole prompt
    ship_start: int = -1  # the fixed chunk's first position; -1: same as start
    num_cached_tokens: int = 0  # the prompt's tokens taken from the prefix cache

    @property
    def is_last(self) -> bool:
        return self.end == self.num_tokens

    @property
    def num_compute_tokens(self) -> int:
        return self.end - self.start

    def block_range(self, block_size: int) -> tuple[int, int]:
        """Indices [first, last) into the prompt's blocks that this chunk ships.

        A non-last chunk ends on a block boundary; the last one also covers the partial block.
        """
        ship_start = self.start if self.ship_start < 0 else self.ship_start
        first = ship_start // block_size
        last = blocks_needed(self.end, block_size) if self.is_last else self.end // block_size
        return first, last


class Step(NamedTuple):
    """One forward pass: chunks of one or more prompts, packed."""

    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        """Tokens computed (ship-only chunks count 0)."""
        return sum(c.end - c.start for c in self.chunks)


@dataclass
class _Prompt:
    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0  # prompt tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)  # [] while waiting
    # Keys of the prompt's full blocks, hashed once at `add` (a waiting prompt is looked up again
    # at every step until admitted; each computed chunk's blocks are inserted); None: the prompt
    # is not looked up in the prefix cache.
    block_keys: list[bytes] | None = None
    num_cached_tokens: int = 0  # set at admission
    reuse_cached: bool = True  # False: looked up nowhere, every position computed


class Scheduler:
    """Token-budget batching with fixed chunk plans over this instance's `BlockPool`.

    Not thread-safe: one owner (the worker, under its lock) calls everything.
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        block_size: int,
        max_batch_tokens: int,
        max_queued_tokens: int,
        prefix_caching: bool = False,
    ) -> None:
        if max_batch_tokens < block_size:
            raise ValueError(f"max_batch_tokens {max_batch_tokens} < block_size {block_size}")
        self.pool = pool
        self.prefix_cache = PrefixCache(pool, block_size, enabled=prefix_caching)
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queued_tokens = max_queued_tokens
        self.chunk_tokens = max_batch_tokens // block_size * block_size
        self._waiting: OrderedDict[str, _Prompt] = OrderedDict()
        self._running: OrderedDict[str, _Prompt] = OrderedDict()  # admitted, chunks to go
        self._computed: dict[str, _Prompt] = {}  # all KV computed, blocks held until removed
        # Queue room held by `reserve` for a prompt not added yet: request id -> its tokens.
        self._reserved: dict[str, int] = {}
        self.num_queued_tokens = 0  # tokens of every prompt reserved or added, not yet removed
        # The last step left a running chunk out for short waiting prompts: the next one puts
        # running prompts first again, so a long prompt computes at least every other step.
        self._has_yielded = False

    # ---- chunk plan --------------------------------------------------------------------------

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """The fixed chunks [start, end) of a prompt of `num_tokens` tokens."""
        c = self.chunk_tokens
        return [(s, min(s + c, num_tokens)) for s in range(0, num_tokens, c)]

    def num_chunks(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.chunk_tokens)

    def num_shipped_chunks(self, num_tokens: int, num_skipped_blocks: int) -> int:
        """Chunks that ship any block when decode already holds the first `num_skipped_blocks`
        (a chunk whose blocks are all held ships nothing and is not counted)."""
        shipped = 0
        for start, end in self.chunk_bounds(num_tokens):
            chunk = ScheduledChunk("", start, end, num_tokens, [])
            shipped += chunk.block_range(self.block_size)[1] > num_skipped_blocks
        return shipped

    def max_prompt_tokens(self) -> int:
        """Longest prompt that can ever be admitted: the queue bound and the whole pool."""
        return min(self.max_queued_tokens, self.pool.num_blocks * self.block_size)

    # ---- queue -------------------------------------------------------------------------------

    def reserve(
        self, request_id: str, num_tokens: int, *, retry_after_s: float | None = None
    ) -> None:
        """Hold queue room for a prompt that `add` queues later, raising now what `add` would
        (RESOURCE_EXHAUSTED, InvalidArgument): once reserved, `add` cannot refuse it. Prefill
        reserves before the transfer's header goes out to decode, so a full queue is refused
        before decode hears of the prompt. `remove` gives the room back on every path."""
        self.check(request_id, num_tokens, retry_after_s=retry_after_s)
        self._reserved[request_id] = num_tokens
        self.num_queued_tokens += num_tokens

    def add(
        self,
        request_id: str,
        num_tokens: int,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        retry_after_s: float | None = None,
        reuse_cached: bool = True,
    ) -> None:
        """Queue a prompt; RESOURCE_EXHAUSTED when the queued tokens would pass the bound,
        unless `reserve` held its room (then it is queued without a second check).

        With `prompt_token_ids` (len == num_tokens) the prompt may reuse cached blocks, unless
        `reuse_cached` is False (every position computed: prompt logprobs need their logits);
        its computed blocks join the cache either way.
        """
        if prompt_token_ids is not None and len(prompt_token_ids) != num_tokens:
            raise ValueError(f"{len(prompt_token_ids)} prompt token ids for {num_tokens} tokens")
        reserved = self._reserved.get(request_id)
        if reserved is None:
            self.check(request_id, num_tokens, retry_after_s=retry_after_s)
        elif reserved != num_tokens:
            raise ValueError(f"{num_tokens} tokens added for {reserved} reserved")
        keys = None
        if prompt_token_ids is not None and self.prefix_cache.enabled:
            keys = self.prefix_cache.keys(prompt_token_ids)
        self._waiting[request_id] = _Prompt(
            request_id, num_tokens, block_keys=keys, reuse_cached=reuse_cached
        )
        if reserved is None:
            self.num_queued_tokens += num_tokens
        else:
            del self._reserved[request_id]  # its tokens are counted already

    def check(
        self, request_id: str, num_tokens: int, *, retry_after_s: float | None = None
    ) -> None:
        """Raise what `add` would raise, changing nothing."""
        if request_id in self:
            raise InvalidArgument("request_id", request_id, "is already being prefilled here")
        if not 0 < num_tokens <= self.max_prompt_tokens():
            raise InvalidArgument(
                "token_ids",
                count_of(num_tokens, "token"),
                f"must be 1 to {self.max_prompt_tokens()} tokens on this instance",
            )
        if self.num_queued_tokens + num_tokens > self.max_queued_tokens:
            queued = plural(self.num_queued_tokens, "prompt token")
            raise ResourceExhausted(
                f"prefill queue is full: {queued} queued or in flight, {num_tokens} more would "
                f"pass the limit of {self.max_queued_tokens}; "
                "retry later or on another prefill instance",
                retry_after_s=retry_after_s,
            )

    def remove(self, request_id: str) -> bool:
        """Forget a prompt in any state (reserved included) and free its blocks; False when it
        was not here.

        Safe while a step holding one of its chunks is computing: freed blocks are handed out
        again only by the next `schedule`, which the worker calls after that step ended.
        """
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:  # reserved, never added
            self.num_queued_tokens -= reserved
            return True
        prompt = (
            self._waiting.pop(request_id, None)
            or self._running.pop(request_id, None)
            or self._computed.pop(request_id, None)
        )
        if prompt is None:
            return False
        self.prefix_cache.free(prompt.block_table)
        prompt.block_table = []
        self.num_queued_tokens -= prompt.num_tokens
        return True

    def __contains__(self, request_id: object) -> bool:
        return (
            request_id in self._reserved
            or request_id in self._waiting
            or request_id in self._running
            or request_id in self._computed
        )

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---- steps -------------------------------------------------------------------------------

    def schedule(self) -> Step | None:
        """The next forward's chunks (admitting waiting prompts), or None when idle."""
        running = list(self._running.values())  # before this step admits anyone
        chunks: list[ScheduledChunk] = []
        is_yielding = not self._has_yielded and self._is_short_one_held_back(running)
        budget = self.max_batch_tokens
        if not is_yielding:
            budget = self._add_running(running, chunks, budget)
        budget = self._admit(chunks, budget, only_done_now=is_yielding)
        if is_yielding:
            num_before = len(chunks)
            self._add_running(running, chunks, budget)
            # Only a yield that left a running chunk out counts: that prompt goes first next.
            self._has_yielded = len(chunks) - num_before < len(running)
        else:
            self._has_yielded = False
        return Step(chunks) if chunks else None

    def _is_short_one_held_back(self, running: list[_Prompt]) -> bool:
        """Whether a waiting prompt computed whole in one step would not fit beside the running
        prompts' next chunks: one of one chunk (its length, a cheap upper bound), or a longer
        one whose cached prefix leaves only its last chunk to compute (a chat's next turn)."""
        if not running:
            return False
        budget = self._add_running(running, [], self.max_batch_tokens)
        for prompt in self._waiting.values():
            if prompt.num_tokens <= self.chunk_tokens:
                if budget < prompt.num_tokens:
                    return True
                continue
            num_cached_tokens = self._num_cached_now(prompt)
            size = self._first_size(prompt, num_cached_tokens)
            if budget < size and num_cached_tokens + size == prompt.num_tokens:
                return True
        return False

    def _num_cached_now(self, prompt: _Prompt) -> int:
        """The tokens `_match` would find cached for a waiting prompt of several chunks now,
        taking nothing; 0 where they would not reach its last chunk. The block just before
        that chunk is looked at first: a queue of prompts that share a long cached prefix but
        not their ends costs one lookup each, not a walk of the prefix each, every step."""
        keys = prompt.block_keys
        if keys is None or not prompt.reuse_cached:
            return 0
        last_start = (prompt.num_tokens - 1) // self.chunk_tokens * self.chunk_tokens
        num_needed = last_start // self.block_size  # blocks cached for the last chunk alone
        if not self.prefix_cache.is_cached(keys[num_needed - 1]):
            return 0
        max_blocks = max_cached_blocks(prompt.num_tokens, self.block_size)
        num_blocks = self.prefix_cache.num_matching(keys, max_blocks=max_blocks)
        return num_blocks * self.block_size

    def _add_running(
        self, running: list[_Prompt], chunks: list[ScheduledChunk], budget: int
    ) -> int:
        """Append the next chunk of each running prompt that fits, oldest first; the budget left."""
        for prompt in running:
            chunk = self._next_chunk(prompt)
            if chunk.end - chunk.start <= budget:
                chunks.append(chunk)
                budget -= chunk.end - chunk.start
        return budget

    def _admit(self, chunks: list[ScheduledChunk], budget: int, *, only_done_now: bool) -> int:
        """Admit waiting prompts, FIFO and first fit, appending their first chunks (and any
        ship-only ones before them); the budget left. `only_done_now`: only prompts computed
        whole in this step (a yield to short prompts admits no long one)."""
        skipped = False  # a waiting prompt did not fit the budget left
        for prompt in list(self._waiting.values()):
            if budget == 0:  # every chunk computes a token at least: none fits (and no match)
                break
            cached = self._match(prompt)
            num_cached_tokens = len(cached) * self.block_size
            c = self.chunk_tokens
            size = self._first_size(prompt, num_cached_tokens)
            need = blocks_needed(prompt.num_tokens, self.block_size) - len(cached)
            # Past a skipped prompt, only prompts done in this step: one that ran on would take
            # part of the next budgets too, and a stream of them could starve the skipped one.
            is_done_now = num_cached_tokens + size == prompt.num_tokens
            is_over_budget = size > budget or ((skipped or only_done_now) and not is_done_now)
            if is_over_budget or need > self.prefix_cache.num_available:
                self.prefix_cache.free(cached)
                if is_over_budget:
                    skipped = True
                    continue
                break
            prompt.block_table = cached + self.prefix_cache.allocate(need)
            prompt.num_computed_tokens = prompt.num_cached_tokens = num_cached_tokens
            self.prefix_cache.record(prompt.num_tokens, len(cached))
            del self._waiting[prompt.request_id]
            self._running[prompt.request_id] = prompt
            for ship_start in range(0, num_cached_tokens - num_cached_tokens % c, c):
                chunks.append(  # ship-only: wholly cached
                    ScheduledChunk(
                        prompt.request_id,
                        ship_start + c,
                        ship_start + c,
                        prompt.num_tokens,
                        prompt.block_table,
                        ship_start,
                    )
                )
            chunks.append(self._next_chunk(prompt))
            budget -= size
        return budget

    def _first_size(self, prompt: _Prompt, num_cached_tokens: int) -> int:
        """Tokens the step that admits `prompt` computes: from the end of its cached prefix to
        the end of the fixed chunk that holds it."""
        c = self.chunk_tokens
        return min((num_cached_tokens // c + 1) * c, prompt.num_tokens) - num_cached_tokens

    def _match(self, prompt: _Prompt) -> list[int]:
        """Cached leading blocks for a waiting prompt (one reference each); [] without ids."""
        if prompt.block_keys is None or not prompt.reuse_cached:
            return []
        max_blocks = max_cached_blocks(prompt.num_tokens, self.block_size)
        return self.prefix_cache.match_keys(prompt.block_keys, max_blocks=max_blocks)

    def complete(self, step: Step) -> list[str]:
        """Record a finished forward; return the request ids whose whole prompt is now computed.

        Chunks of prompts removed meanwhile are ignored.
        """
        done: list[str] = []
        for chunk in step.chunks:
            prompt = self._running.get(chunk.request_id)
            if (
                prompt is None
                or chunk.start == chunk.end
                or prompt.num_computed_tokens != chunk.start
            ):
                continue
            prompt.num_computed_tokens = chunk.end
            if prompt.block_keys is not None:
                full = chunk.end // self.block_size
                self.prefix_cache.insert_keys(prompt.block_keys[:full], prompt.block_table)
            if chunk.is_last:
                del self._running[chunk.request_id]
                self._computed[chunk.request_id] = prompt
                done.append(chunk.request_id)
        return done

    def _next_chunk(self, prompt: _Prompt) -> ScheduledChunk:
        """The fixed chunk holding the first position not yet computed."""
        start = prompt.num_computed_tokens
        ship_start = start // self.chunk_tokens * self.chunk_tokens
        end = min(ship_start + self.chunk_tokens, prompt.num_tokens)
        return ScheduledChunk(
            prompt.request_id,
            start,
            end,
            prompt.num_tokens,
            prompt.block_table,
            ship_start,
            prompt.num_cached_tokens,
        )
