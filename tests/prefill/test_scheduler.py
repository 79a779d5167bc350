"""The prefill scheduler's plans, exactly: which chunks of which prompts go in which forward."""

from __future__ import annotations

import pytest

from mili.engine.kv.block_pool import BlockPool
from mili.errors import InvalidArgument, ResourceExhausted
from services.prefill.scheduler import ScheduledChunk, Scheduler, Step


def make(num_blocks: int = 64, max_batch_tokens: int = 16, max_queued: int = 1000) -> Scheduler:
    # block_size 4: chunk_tokens = 16 here, small numbers keep the expectations readable.
    return Scheduler(
        BlockPool(num_blocks),
        block_size=4,
        max_batch_tokens=max_batch_tokens,
        max_queued_tokens=max_queued,
    )


def plan(step: Step | None) -> list[tuple[str, int, int]]:
    assert step is not None
    return [(c.request_id, c.start, c.end) for c in step.chunks]


def run_all(s: Scheduler) -> list[list[tuple[str, int, int]]]:
    steps = []
    while (step := s.schedule()) is not None:
        steps.append(plan(step))
        s.complete(step)
    return steps


def test_chunk_plan_is_fixed_by_length_and_ends_on_block_boundaries() -> None:
    s = make(max_batch_tokens=18)  # 18 rounds down to 16 = 4 whole blocks of 4
    assert s.chunk_tokens == 16
    assert s.chunk_bounds(5) == [(0, 5)]
    assert s.chunk_bounds(16) == [(0, 16)]
    assert s.chunk_bounds(17) == [(0, 16), (16, 17)]
    assert s.chunk_bounds(40) == [(0, 16), (16, 32), (32, 40)]
    assert [s.num_chunks(n) for n in (1, 16, 17, 40)] == [1, 1, 2, 3]


def test_block_range_ships_completed_blocks_and_the_last_partial_one() -> None:
    table = [10, 11, 12, 13, 14, 15]
    # block_size 4, prompt of 22 tokens: chunks [0,16) [16,22); blocks |0-3|4-7|...|20-21|
    assert ScheduledChunk("r", 0, 16, 22, table).block_range(4) == (0, 4)
    assert ScheduledChunk("r", 16, 22, 22, table).block_range(4) == (4, 6)
    assert ScheduledChunk("r", 0, 3, 3, table).block_range(4) == (0, 1)  # shorter than a block
    assert ScheduledChunk("r", 0, 8, 8, table).block_range(4) == (0, 2)  # exactly two blocks


def test_concurrent_prompts_share_one_forward_under_the_budget() -> None:
    s = make()
    for rid, n in (("a", 5), ("b", 6), ("c", 5), ("d", 3)):
        s.add(rid, n)
    step = s.schedule()
    assert plan(step) == [("a", 0, 5), ("b", 0, 6), ("c", 0, 5)]  # 16 tokens: the budget
    assert step is not None and step.num_tokens == 16
    # Blocks are taken in admission order, all of a prompt's at once.
    assert [c.block_table for c in step.chunks] == [[0, 1], [2, 3], [4, 5]]
    assert s.complete(step) == ["a", "b", "c"]
    assert plan(s.schedule()) == [("d", 0, 3)]


def test_long_prompt_is_chunked_and_its_last_chunk_shares_a_forward() -> None:
    s = make()
    s.add("long", 40)
    s.add("big", 30)  # two chunks: waits for the budget, never skips ahead of long
    for expected in ([("long", 0, 16)], [("long", 16, 32)]):  # the whole budget, twice
        step = s.schedule()
        assert plan(step) == expected
        assert step is not None
        s.complete(step)
    s.add("short", 7)
    # short (7) fills what long's last chunk (8) leaves; big's first chunk (16) does not fit.
    assert run_all(s) == [
        [("long", 32, 40), ("short", 0, 7)],
        [("big", 0, 16)],
        [("big", 16, 30)],
    ]


def test_a_short_prompt_behind_a_long_one_goes_first_once() -> None:
    """Short prompts queued behind a running long one do not wait for all of its chunks: the
    next step is theirs (only prompts computed whole in it are admitted, never the long big),
    then the running prompt goes first again."""
    s = make()
    s.add("long", 40)
    s.add("big", 30)
    s.add("short", 7)
    s.add("tiny", 1)
    assert run_all(s) == [
        [("long", 0, 16)],
        [("short", 0, 7), ("tiny", 0, 1)],  # long's next chunk (16) no longer fits
        [("long", 16, 32)],
        [("long", 32, 40)],
        [("big", 0, 16)],
        [("big", 16, 30)],
    ]


def test_short_prompts_arriving_during_a_long_prompt_wait_one_step_at_most() -> None:
    """A short prompt used to wait for every chunk of a long prompt running ahead of it (10
    steps here; a 16k-token prompt at the default budget: 8). Now, with a short prompt arriving
    before every step, each is scheduled within two steps of its arrival (the step that comes
    first is the long prompt's), and the long prompt still computes every other step."""
    s = make(max_batch_tokens=16)
    s.add("long", 160)  # 10 chunks of 16
    waited: dict[str, int] = {}  # short prompt -> schedule() calls until it was in a step
    arrived: dict[str, int] = {}
    long_steps = []
    for n in range(40):
        s.add(f"s{n}", 6)
        arrived[f"s{n}"] = n
        step = s.schedule()
        assert step is not None and step.num_tokens <= 16
        for c in step.chunks:
            if c.request_id == "long":
                long_steps.append(n)
            else:
                waited[c.request_id] = n - arrived[c.request_id]
        for request_id in s.complete(step):
            s.remove(request_id)
        if "long" not in s and n >= 20:
            break
    assert len(long_steps) == 10
    assert long_steps[-1] <= 19, long_steps  # long computes at least every other step
    assert waited["s1"] == 0  # arrived while long's first chunk ran: scheduled next
    assert max(waited.values()) <= 1, waited
    assert all(f"s{k}" in waited for k in range(n)), "a short prompt was never scheduled"


def test_a_short_prompt_without_blocks_does_not_hold_a_long_one_back() -> None:
    """Making room for a short prompt that cannot get its blocks would be a wasted step: the
    long prompt's chunks go on every step, and the short one waits for memory (FIFO by memory)."""
    s = make(num_blocks=12)  # 48 tokens
    s.add("long", 40)  # 10 blocks
    s.add("short", 12)  # 3 blocks, 2 free
    assert run_all(s) == [[("long", 0, 16)], [("long", 16, 32)], [("long", 32, 40)]]
    s.remove("long")
    assert run_all(s) == [[("short", 0, 12)]]


def test_running_prompts_go_first_then_waiting_ones_first_fit() -> None:
    s = make()
    s.add("a", 20)  # 16 + 4
    step = s.schedule()
    assert plan(step) == [("a", 0, 16)]
    s.add("big", 30)  # its first chunk (16) does not fit the 12 tokens a's last chunk leaves
    s.add("small", 10)  # fits: jumps ahead of big for this forward only
    assert step is not None
    s.complete(step)
    step = s.schedule()
    assert plan(step) == [("a", 16, 20), ("small", 0, 10)]
    assert step is not None
    s.complete(step)
    assert plan(s.schedule()) == [("big", 0, 16)]


def test_blocks_run_out_and_waiting_prompts_wait_for_removed_ones() -> None:
    s = make(num_blocks=6)
    s.add("a", 12)  # 3 blocks
    s.add("b", 12)  # 3 blocks, but only 4 tokens of budget are left after a: skipped
    s.add("c", 4)  # 1 block, fits the 4 tokens left
    step = s.schedule()
    assert plan(step) == [("a", 0, 12), ("c", 0, 4)]
    assert step is not None and [c.block_table for c in step.chunks] == [[0, 1, 2], [3]]
    assert s.complete(step) == ["a", "c"]
    assert s.schedule() is None  # b needs 3 blocks, 2 are free: a and c hold theirs
    s.remove("a")  # a's transfer was acknowledged
    step = s.schedule()
    assert plan(step) == [("b", 0, 12)]
    assert step is not None and step.chunks[0].block_table == [4, 5, 0]


def test_fifo_by_memory_when_the_head_cannot_get_blocks() -> None:
    s = make(num_blocks=4)
    s.add("a", 8)  # 2 blocks, computed and held (its transfer is in flight)
    step = s.schedule()
    assert step is not None and s.complete(step) == ["a"]
    s.add("big", 12)  # needs 3, only 2 free
    s.add("small", 4)  # needs 1 and fits: must still not take blocks ahead of big
    assert s.schedule() is None
    s.remove("a")
    assert run_all(s) == [[("big", 0, 12), ("small", 0, 4)]]
    assert s.pool.num_free == 0


def test_blocks_are_held_after_compute_until_removed() -> None:
    s = make(num_blocks=8)
    s.add("a", 9)  # 3 blocks
    step = s.schedule()
    assert step is not None and s.pool.num_free == 5
    assert s.complete(step) == ["a"]
    assert s.pool.num_free == 5 and s.num_queued_tokens == 9  # transfer still in flight
    assert s.schedule() is None
    assert s.remove("a") is True
    assert s.pool.num_free == 8 and s.num_queued_tokens == 0
    assert s.remove("a") is False  # idempotent


def test_remove_while_computing_drops_the_rest_of_the_prompt() -> None:
    s = make()
    s.add("long", 40)
    s.add("other", 4)
    step = s.schedule()
    assert plan(step) == [("long", 0, 16)]
    s.remove("long")  # the caller went away mid-forward
    assert step is not None
    assert s.complete(step) == []  # its finished chunk is ignored
    assert run_all(s) == [[("other", 0, 4)]]
    s.remove("other")
    assert s.pool.num_free == s.pool.num_blocks and s.num_queued_tokens == 0


def test_queue_bound_counts_queued_computing_and_transferring_tokens() -> None:
    s = make(max_queued=20)
    s.add("a", 12)
    with pytest.raises(ResourceExhausted, match="12 prompt tokens queued") as info:
        s.add("b", 9, retry_after_s=0.5)
    assert info.value.retry_after_s == 0.5
    s.add("c", 8)  # exactly at the bound
    assert s.num_queued_tokens == 20
    s.remove("a")
    s.add("b", 9)


def test_reserved_room_counts_against_the_bound_and_add_cannot_refuse_it() -> None:
    # The race of issue 29: two prompts checked against a bound just above one of them, both
    # headers out to decode, then the second refused. Reserving takes the room at the check.
    s = make(max_queued=12)
    s.reserve("a", 10)
    assert s.num_queued_tokens == 10 and "a" in s
    with pytest.raises(ResourceExhausted, match="10 prompt tokens queued"):
        s.reserve("b", 10)
    with pytest.raises(InvalidArgument, match="already being prefilled"):
        s.reserve("a", 1)
    assert s.schedule() is None  # reserved room is not a prompt to compute
    s.add("a", 10, prompt_token_ids=list(range(10)))  # into its room: no second check
    assert s.num_queued_tokens == 10 and s.num_waiting == 1
    assert plan(s.schedule()) == [("a", 0, 10)]


def test_removing_a_reservation_gives_its_room_back() -> None:
    s = make(max_queued=12)
    s.reserve("a", 10)
    assert s.remove("a")
    assert s.num_queued_tokens == 0 and "a" not in s
    assert not s.remove("a")
    s.reserve("b", 12)
    with pytest.raises(ValueError, match="11 tokens added for 12 reserved"):
        s.add("b", 11)
    assert s.num_queued_tokens == 12  # the reservation stands
    s.add("b", 12)
    assert s.remove("b")
    assert s.num_queued_tokens == 0


def test_prompts_that_can_never_fit_and_duplicates_are_invalid() -> None:
    s = make(num_blocks=4, max_queued=100)  # the pool holds 16 tokens
    assert s.max_prompt_tokens() == 16
    with pytest.raises(InvalidArgument, match="1 to 16 tokens"):
        s.add("huge", 17)
    s.add("a", 3)
    with pytest.raises(InvalidArgument, match="already being prefilled"):
        s.add("a", 3)


# ---- prefix cache ----------------------------------------------------------------------------


def make_cached(num_blocks: int = 64, max_batch_tokens: int = 8) -> Scheduler:
    # block_size 4, chunk_tokens 8: [0, 8) [8, 16) [16, 24) ...
    return Scheduler(
        BlockPool(num_blocks),
        block_size=4,
        max_batch_tokens=max_batch_tokens,
        max_queued_tokens=1000,
        prefix_caching=True,
    )


def shipped(step: Step) -> list[tuple[str, int, int, tuple[int, int]]]:
    return [(c.request_id, c.start, c.end, c.block_range(4)) for c in step.chunks]


def test_a_cached_prefix_is_shipped_without_compute_and_the_plan_keeps_its_chunks() -> None:
    s = make_cached()
    first = list(range(100, 119))  # 19 tokens: chunks [0,8) [8,16) [16,19)
    s.add("a", 19, prompt_token_ids=first)
    while (step := s.schedule()) is not None:
        s.complete(step)
    assert s.prefix_cache.num_cached == 4  # blocks 0-3 full; block 4 holds 3 tokens
    table_a = s._computed["a"].block_table

    # same 12 tokens, then different: 3 cached blocks -> compute from 12
    second = first[:12] + [7] * 7
    s.add("b", 19, prompt_token_ids=second)
    step = s.schedule()
    assert step is not None
    assert shipped(step) == [("b", 8, 8, (0, 2)), ("b", 12, 16, (2, 4))]
    assert step.num_tokens == 4
    table_b = s._running["b"].block_table
    assert table_b[:3] == table_a[:3] and table_b[3] not in table_a
    s.complete(step)
    step = s.schedule()
    assert step is not None and shipped(step) == [("b", 16, 19, (4, 5))]
    assert s.complete(step) == ["b"]
    assert s.num_chunks(19) == 3  # the header's count: one shipped chunk per fixed chunk


def test_an_identical_prompt_still_computes_its_last_token() -> None:
    s = make_cached()
    prompt = list(range(16))  # exactly 4 blocks, 2 chunks
    s.add("a", 16, prompt_token_ids=prompt)
    run_all(s)
    s.add("b", 16, prompt_token_ids=prompt)
    step = s.schedule()
    assert step is not None
    # 3 blocks reused (max (16-1)//4), the last block recomputed from 12
    assert shipped(step) == [("b", 8, 8, (0, 2)), ("b", 12, 16, (2, 4))]
    assert s.prefix_cache.stats.hit_tokens == 12


def test_removing_prompts_returns_every_block_once_the_cache_is_cleared() -> None:
    s = make_cached(num_blocks=16)
    s.add("a", 10, prompt_token_ids=list(range(10)))
    run_all(s)
    s.add("b", 10, prompt_token_ids=list(range(10)))
    step = s.schedule()
    assert step is not None
    s.remove("a")
    s.remove("b")  # removed mid-compute: its chunk's blocks are not cached
    s.complete(step)
    assert s.prefix_cache.num_cached == 2  # a's two full blocks
    assert s.prefix_cache.clear() == 2 and s.pool.num_free == 16


def test_cached_blocks_are_evicted_for_a_prompt_that_needs_the_room() -> None:
    s = make_cached(num_blocks=4)
    s.add("a", 16, prompt_token_ids=list(range(16)))
    run_all(s)
    s.remove("a")
    assert s.pool.num_free == 0 and s.prefix_cache.num_evictable == 4
    s.add("b", 16, prompt_token_ids=[9] * 16)
    step = s.schedule()
    assert step is not None and s.prefix_cache.stats.evicted_blocks == 4
    assert shipped(step) == [("b", 0, 8, (0, 2))]


def test_without_prompt_ids_or_with_caching_off_nothing_is_reused() -> None:
    s = make()  # caching off
    s.add("a", 8, prompt_token_ids=list(range(8)))
    run_all(s)
    s.add("b", 8, prompt_token_ids=list(range(8)))
    assert run_all(s) == [[("b", 0, 8)]]
    c = make_cached()
    c.add("a", 8)
    run_all(c)
    assert c.prefix_cache.num_cached == 0


def test_a_skipped_prompt_is_not_starved_by_later_prompts_that_run_on() -> None:
    """Found by a read-only review: a 14-token prompt skipped for the budget a running prompt
    left was skipped for good while prompts with a cached prefix kept arriving: each fitted the
    gap with a small first chunk, then ran on and left a gap too small again. Past a skipped
    prompt only prompts computed whole in the step are admitted."""
    s = make_cached(num_blocks=256, max_batch_tokens=16)
    system = list(range(1000, 1012))  # 12 tokens (3 blocks) every long prompt shares
    s.add("warm", 13, prompt_token_ids=[*system, 1])
    run_all(s)
    s.remove("warm")

    def add_long(n: int) -> None:  # 36 tokens, 12 cached: first chunk computes 4
        s.add(f"long-{n}", 36, prompt_token_ids=[*system, *[5000 + n] * 24])

    add_long(0)
    step = s.schedule()
    assert step is not None
    s.complete(step)
    s.add("short", 14, prompt_token_ids=[7] * 14)  # one chunk of 14
    for n in range(1, 20):
        if n % 2:
            add_long(n)
        step = s.schedule()
        assert step is not None and step.num_tokens <= 16
        if "short" in {c.request_id for c in step.chunks}:
            break
        for request_id in s.complete(step):
            s.remove(request_id)
    else:
        raise AssertionError("the short prompt was never scheduled")
    assert n <= 4, n  # once long-0 is done, the next step is the short prompt's


def test_no_waiting_prompt_is_looked_up_once_the_budget_is_spent() -> None:
    """A step whose running chunks take the whole budget admits no one: the waiting prompts'
    prefix lookups (hashing, and refreshing their cached blocks' recency) are skipped."""
    s = make_cached(max_batch_tokens=16)
    s.add("long", 40, prompt_token_ids=list(range(40)))
    step = s.schedule()
    assert plan(step) == [("long", 0, 16)]
    assert step is not None
    s.complete(step)
    for i in range(3):  # of two chunks each: no short prompt to make room for
        s.add(f"w{i}", 20, prompt_token_ids=[100 + i] * 20)
    looked_up: list[int] = []
    match_keys = s.prefix_cache.match_keys

    def spy(keys: object, **kwargs: object) -> list[int]:
        looked_up.append(1)
        return match_keys(keys, **kwargs)  # type: ignore[arg-type]

    s.prefix_cache.match_keys = spy  # type: ignore[method-assign]
    assert plan(s.schedule()) == [("long", 16, 32)]
    assert looked_up == []


def test_a_prompt_whose_cached_prefix_leaves_one_chunk_goes_first_like_a_short_one() -> None:
    """A chat's next turn is long by its length but short by what it computes: its history is
    cached. Only prompts of one chunk by length made a step yield, so such a prompt waited for
    every chunk of a long prompt running ahead of it (through mili serve on the demo model at
    --max-batch-tokens 512: a 2,016-token follow-up of a cached 2,000-token prompt, 32 tokens to
    compute, waited for a 4,000-token prompt's remaining chunks, where a 64-token prompt got the
    next step). Now it goes in the next step as a short one does; the long one first again."""
    s = make_cached(num_blocks=128, max_batch_tokens=16)
    history = list(range(100, 132))  # 32 tokens: 8 blocks, two chunks
    s.add("history", 32, prompt_token_ids=history)
    assert run_all(s) == [[("history", 0, 16)], [("history", 16, 32)]]
    s.remove("history")  # its blocks stay cached
    s.add("long", 48, prompt_token_ids=list(range(48)))
    assert plan(s.schedule()) == [("long", 0, 16)]
    s.complete(Step([ScheduledChunk("long", 0, 16, 48, [])]))
    s.add("turn", 37, prompt_token_ids=[*history, 1, 2, 3, 4, 5])  # [32, 37) to compute
    steps = run_all(s)
    # Cached chunks [0, 16) and [16, 32) are shipped with the computed [32, 37) in one step.
    assert steps[0] == [("turn", 16, 16), ("turn", 32, 32), ("turn", 32, 37)]
    assert steps[1:] == [[("long", 16, 32)], [("long", 32, 48)]]
    for request_id in ("long", "turn"):
        s.remove(request_id)
    s.prefix_cache.clear()  # the yield's look at the cache took no reference: every block back
    assert s.prefix_cache.num_available == 128 and s.prefix_cache.num_cached == 0


def test_a_prompt_whose_cached_prefix_leaves_more_than_one_chunk_waits_its_turn() -> None:
    """Sharing a cached prefix is not enough: a prompt whose uncached part spans two chunks is
    not computed whole in one step, so it is admitted as a long one, after the running one."""
    s = make_cached(num_blocks=128, max_batch_tokens=16)
    history = list(range(100, 132))
    s.add("history", 32, prompt_token_ids=history)
    run_all(s)
    s.remove("history")
    s.add("long", 48, prompt_token_ids=list(range(48)))
    assert plan(s.schedule()) == [("long", 0, 16)]
    s.complete(Step([ScheduledChunk("long", 0, 16, 48, [])]))
    s.add("other", 52, prompt_token_ids=[*history, *range(20)])  # [32, 52): two chunks
    steps = run_all(s)
    assert steps[:2] == [[("long", 16, 32)], [("long", 32, 48)]]
    assert steps[2:] == [
        [("other", 16, 16), ("other", 32, 32), ("other", 32, 48)],
        [("other", 48, 52)],
    ]
