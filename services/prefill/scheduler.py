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
     (a later, shorter one may fill the gap: first fit by tokens), but one that cannot get its
     blocks stops admission (FIFO by memory, so a long prompt is not starved by short ones).
A prompt gets all of its blocks when admitted and keeps them until `remove` (the transfer was
acknowledged, failed or cancelled): a running prompt can never deadlock waiting for blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from mili.engine.block_pool import BlockPool, blocks_needed
from mili.errors import InvalidArgument, ResourceExhausted


class ScheduledChunk(NamedTuple):
    """Prompt positions [start, end) of one request, computed in one step."""

    request_id: str
    start: int
    end: int
    num_tokens: int  # the whole prompt's length
    block_table: list[int]  # this instance's block ids of the whole prompt

    @property
    def is_last(self) -> bool:
        return self.end == self.num_tokens

    def block_range(self, block_size: int) -> tuple[int, int]:
        """Indices [first, last) into the prompt's blocks that this chunk completes.

        A non-last chunk ends on a block boundary; the last one also covers the partial block.
        """
        first = self.start // block_size
        last = blocks_needed(self.end, block_size) if self.is_last else self.end // block_size
        return first, last


class Step(NamedTuple):
    """One forward pass: chunks of one or more prompts, packed."""

    chunks: list[ScheduledChunk]

    @property
    def num_tokens(self) -> int:
        return sum(c.end - c.start for c in self.chunks)


@dataclass
class _Prompt:
    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0  # prompt tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)  # [] while waiting


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
    ) -> None:
        if max_batch_tokens < block_size:
            raise ValueError(f"max_batch_tokens {max_batch_tokens} < block_size {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queued_tokens = max_queued_tokens
        self.chunk_tokens = max_batch_tokens // block_size * block_size
        self._waiting: OrderedDict[str, _Prompt] = OrderedDict()
        self._running: OrderedDict[str, _Prompt] = OrderedDict()  # admitted, chunks to go
        self._computed: dict[str, _Prompt] = {}  # all KV computed, blocks held until removed
        self.num_queued_tokens = 0  # tokens of every prompt added and not yet removed

    # ---- chunk plan --------------------------------------------------------------------------

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """The fixed chunks [start, end) of a prompt of `num_tokens` tokens."""
        c = self.chunk_tokens
        return [(s, min(s + c, num_tokens)) for s in range(0, num_tokens, c)]

    def num_chunks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.chunk_tokens)

    def max_prompt_tokens(self) -> int:
        """Longest prompt that can ever be admitted: the queue bound and the whole pool."""
        return min(self.max_queued_tokens, self.pool.num_blocks * self.block_size)

    # ---- queue -------------------------------------------------------------------------------

    def add(self, request_id: str, num_tokens: int, *, retry_after_s: float | None = None) -> None:
        """Queue a prompt; RESOURCE_EXHAUSTED when the queued tokens would pass the bound."""
        self.check(request_id, num_tokens, retry_after_s=retry_after_s)
        self._waiting[request_id] = _Prompt(request_id, num_tokens)
        self.num_queued_tokens += num_tokens

    def check(
        self, request_id: str, num_tokens: int, *, retry_after_s: float | None = None
    ) -> None:
        """Raise what `add` would raise, changing nothing."""
        if request_id in self:
            raise InvalidArgument("request_id", request_id, "is already being prefilled here")
        if not 0 < num_tokens <= self.max_prompt_tokens():
            raise InvalidArgument(
                "token_ids",
                f"{num_tokens} tokens",
                f"must be 1 to {self.max_prompt_tokens()} tokens on this instance",
            )
        if self.num_queued_tokens + num_tokens > self.max_queued_tokens:
            raise ResourceExhausted(
                f"prefill queue is full: {self.num_queued_tokens} prompt tokens queued or in "
                f"flight, {num_tokens} more would pass the limit of {self.max_queued_tokens}; "
                "retry later or on another prefill instance",
                retry_after_s=retry_after_s,
            )

    def remove(self, request_id: str) -> bool:
        """Forget a prompt in any state and free its blocks; False when it was not here.

        Safe while a step holding one of its chunks is computing: freed blocks are handed out
        again only by the next `schedule`, which the worker calls after that step ended.
        """
        prompt = (
            self._waiting.pop(request_id, None)
            or self._running.pop(request_id, None)
            or self._computed.pop(request_id, None)
        )
        if prompt is None:
            return False
        self.pool.free(prompt.block_table)
        prompt.block_table = []
        self.num_queued_tokens -= prompt.num_tokens
        return True

    def __contains__(self, request_id: object) -> bool:
        return (
            request_id in self._waiting
            or request_id in self._running
            or (request_id in self._computed)
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
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        for prompt in self._running.values():
            chunk = self._next_chunk(prompt)
            if chunk.end - chunk.start <= budget:
                chunks.append(chunk)
                budget -= chunk.end - chunk.start
        for prompt in list(self._waiting.values()):
            size = min(self.chunk_tokens, prompt.num_tokens)
            if size > budget:
                continue
            need = blocks_needed(prompt.num_tokens, self.block_size)
            if need > self.pool.num_free:
                break
            prompt.block_table = self.pool.allocate(need)
            del self._waiting[prompt.request_id]
            self._running[prompt.request_id] = prompt
            chunks.append(self._next_chunk(prompt))
            budget -= size
        return Step(chunks) if chunks else None

    def complete(self, step: Step) -> list[str]:
        """Record a finished forward; return the request ids whose whole prompt is now computed.

        Chunks of prompts removed meanwhile are ignored.
        """
        done: list[str] = []
        for chunk in step.chunks:
            prompt = self._running.get(chunk.request_id)
            if prompt is None or prompt.num_computed_tokens != chunk.start:
                continue
            prompt.num_computed_tokens = chunk.end
            if chunk.is_last:
                del self._running[chunk.request_id]
                self._computed[chunk.request_id] = prompt
                done.append(chunk.request_id)
        return done

    def _next_chunk(self, prompt: _Prompt) -> ScheduledChunk:
        start = prompt.num_computed_tokens
        end = min(start + self.chunk_tokens, prompt.num_tokens)
        return ScheduledChunk(prompt.request_id, start, end, prompt.num_tokens, prompt.block_table)
