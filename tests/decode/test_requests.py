"""RequestTable bookkeeping with exact block ids: admission, leases, pins, who frees what."""

from __future__ import annotations

import pytest

from mili.engine.kv import block_pool
from mili.engine.kv.block_pool import BlockPool
from mili.engine.sampling_params import SamplingParams
from mili.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from services.decode.requests import HOLD_S, DecodeRequest, RequestState, RequestTable


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def table(num_blocks: int = 10, max_requests: int = 8) -> RequestTable:
    return RequestTable(BlockPool(num_blocks), block_size=4, max_requests=max_requests)


def test_admit_reserves_prompt_and_output_blocks_in_order() -> None:
    t = table()
    a = t.admit("a", [1] * 5, params(4), lease_ms=1000, now=10.0)
    b = t.admit("b", [1] * 3, params(6), lease_ms=500, now=10.0)
    assert (a.block_table, a.prompt_block_ids) == ([0, 1], [0, 1])
    assert (b.block_table, b.prompt_block_ids) == ([2, 3], [2])
    assert a.lease_deadline == 11.0 and b.lease_deadline == 10.5
    assert (t.num_free_blocks, t.num_waiting, t.num_running) == (6, 2, 0)


def test_admit_is_all_or_nothing_with_retry_hint() -> None:
    t = table(num_blocks=6)
    t.admit("a", [1] * 4, params(5), lease_ms=1000, now=0.0)  # 8 positions: blocks 0, 1
    with pytest.raises(ResourceExhausted, match="needs 5") as info:
        t.admit("b", [1] * 10, params(10), lease_ms=1000, now=0.0, retry_after_s=0.5)
    assert info.value.retry_after_s == 0.5
    assert t.num_free_blocks == 4
    later = HOLD_S + 0.1  # b never asked again: the room held for it is given up
    assert t.admit("c", [1] * 16, params(1), lease_ms=1000, now=later).block_table == [2, 3, 4, 5]


def test_room_is_held_for_the_earliest_request_turned_away_for_blocks() -> None:
    """Frontends queue their own requests: another frontend's small requests took every block
    freed while a large one waited, until its deadline. Now the table holds room for the
    earliest one it turned away: others get only what is left over it, until it is admitted
    or stops asking (HOLD_S after its last ask)."""
    t = table(num_blocks=6)
    a = t.admit("a", [1] * 4, params(5), lease_ms=1000, now=0.0)  # blocks 0, 1: 4 free
    with pytest.raises(ResourceExhausted, match="needs 5"):
        t.admit("big", [1] * 10, params(10), lease_ms=1000, now=0.0)
    with pytest.raises(ResourceExhausted, match="5 are held for a request turned away earlier"):
        t.admit("small", [1] * 3, params(1), lease_ms=1000, now=1.0)  # 1 block: 3 left < 5
    with pytest.raises(ResourceExhausted, match="needs 5"):  # it asks again: held on
        t.admit("big", [1] * 10, params(10), lease_ms=1000, now=2.0)
    t.cancel(a)  # 6 free: another may take what the big one leaves, no more
    with pytest.raises(ResourceExhausted, match="held"):
        t.admit("two", [1] * 5, params(1), lease_ms=1000, now=HOLD_S + 1.0)  # 2 blocks
    assert t.admit("small", [1] * 3, params(1), lease_ms=1000, now=HOLD_S + 1.0).block_table
    big = t.admit("big", [1] * 10, params(10), lease_ms=1000, now=HOLD_S + 1.5)
    assert len(big.block_table) == 5 and t.num_free_blocks == 0
    assert a.state is RequestState.DONE
    # a second request turned away while one is held does not take the hold over
    t2 = table(num_blocks=4)
    x = t2.admit("x", [1] * 4, params(5), lease_ms=1000, now=0.0)  # 2 of 4 blocks
    for name in ("first", "second"):
        with pytest.raises(ResourceExhausted, match="not enough KV blocks"):
            t2.admit(name, [1] * 8, params(5), lease_ms=1000, now=0.0)  # 3 blocks each
    t2.cancel(x)
    with pytest.raises(ResourceExhausted, match="held"):
        t2.admit("second", [1] * 8, params(5), lease_ms=1000, now=0.5)
    assert t2.admit("first", [1] * 8, params(5), lease_ms=1000, now=0.5).block_table


def test_a_request_of_a_lower_priority_value_goes_ahead_of_the_room_held() -> None:
    """The hold is first come, first served among equals; a more urgent request (another
    frontend's, whose queue put it first) passes it, and takes it over when turned away."""
    t = table(num_blocks=6)
    a = t.admit("a", [1] * 4, params(5), lease_ms=1000, now=0.0)  # blocks 0, 1: 4 free
    with pytest.raises(ResourceExhausted, match="needs 5"):
        t.admit("big", [1] * 10, params(10), lease_ms=1000, now=0.0, priority=1)
    with pytest.raises(ResourceExhausted, match="held"):  # as urgent: behind the held one
        t.admit("same", [1] * 3, params(1), lease_ms=1000, now=1.0, priority=1)
    assert t.admit("urgent", [1] * 3, params(1), lease_ms=1000, now=1.0, priority=0).block_table
    with pytest.raises(ResourceExhausted, match="needs 5"):  # 3 free: the urgent one's turn
        t.admit("urgent-big", [1] * 10, params(10), lease_ms=1000, now=1.0, priority=0)
    t.cancel(a)  # 5 free: held for urgent-big now, not for big
    with pytest.raises(ResourceExhausted, match="held"):
        t.admit("big", [1] * 10, params(10), lease_ms=1000, now=1.5, priority=1)
    assert t.admit("urgent-big", [1] * 10, params(10), lease_ms=1000, now=1.5, priority=0)


def test_admit_refuses_duplicate_ids_and_past_the_request_bound() -> None:
    t = table(max_requests=2)
    t.admit("a", [1], params(1), lease_ms=1000, now=0.0)
    with pytest.raises(InvalidArgument, match="already exists"):
        t.admit("a", [1], params(1), lease_ms=1000, now=0.0)
    t.admit("b", [1], params(1), lease_ms=1000, now=0.0)
    with pytest.raises(ResourceExhausted, match="limit 2"):
        t.admit("c", [1], params(1), lease_ms=1000, now=0.0)
    assert t.num_free_blocks == 8


def test_lease_expires_only_while_waiting_for_kv_and_frees_to_the_back() -> None:
    t = table()
    a = t.admit("a", [1] * 5, params(4), lease_ms=1000, now=0.0)  # blocks 0, 1
    assert not t.expire(a, now=0.999)
    assert t.expire(a, now=1.0)
    assert a.state is RequestState.DONE and t.get("a") is None
    assert not t.expire(a, now=2.0)  # already ended: nothing freed twice
    assert t.num_free_blocks == 10
    # Freed blocks went to the back of the free queue.
    assert t.admit("b", [1] * 36, params(1), lease_ms=1000, now=0.0).block_table == [
        *range(2, 10),
        0,
    ]


def test_transfer_pins_blocks_until_the_scatter_is_over() -> None:
    t = table()
    a = t.admit("a", [1] * 5, params(4), lease_ms=1000, now=0.0)
    assert t.begin_transfer("a", a.transfer_token) is a
    assert t.pin(a)
    assert t.cancel(a)  # e.g. the caller went away mid-chunk
    assert a.state is RequestState.DONE
    assert t.num_free_blocks == 8  # still held: the copy into blocks 0, 1 is running
    assert not t.pin(a)  # no new chunk for an ended request
    t.unpin(a)
    assert t.num_free_blocks == 10


def test_running_requests_are_freed_by_the_batch_thread_only() -> None:
    t = table()
    a = t.admit("a", [1] * 5, params(4), lease_ms=1000, now=0.0)
    t.begin_transfer("a", a.transfer_token)
    assert t.start_running(a)
    assert (t.num_waiting, t.num_running) == (0, 1)
    assert not t.expire(a, now=100.0)  # the lease covers the wait for KV only
    assert t.cancel(a) and a.is_cancelled
    assert not t.cancel(a)  # flagged once
    assert t.num_free_blocks == 8  # the model may be writing into them this very step
    t.finish(a)
    assert (t.num_free_blocks, t.num_running) == (10, 0)
    t.finish(a)  # idempotent
    assert t.num_free_blocks == 10


def test_begin_transfer_needs_a_waiting_reservation() -> None:
    t = table()
    with pytest.raises(NotFound, match="no reservation"):
        t.begin_transfer("nobody", "")
    a = t.admit("a", [1], params(1), lease_ms=1000, now=0.0)
    t.begin_transfer("a", a.transfer_token)
    with pytest.raises(NotFound, match="transferring"):
        t.begin_transfer("a", a.transfer_token)
    assert t.cancel(a)
    assert not t.start_running(a)  # a commit after the request ended changes nothing
    with pytest.raises(NotFound):
        t.begin_transfer("a", a.transfer_token)


def test_begin_transfer_needs_the_request_token_and_changes_nothing_without_it() -> None:
    t = table()
    a = t.admit("a", [1] * 5, params(4), lease_ms=1000, now=0.0)
    b = t.admit("b", [1] * 5, params(4), lease_ms=1000, now=0.0)
    assert len(a.transfer_token) == 32 and a.transfer_token != b.transfer_token
    for token in ("", b.transfer_token, a.transfer_token.upper()):
        with pytest.raises(PermissionDenied, match="transfer token"):
            t.begin_transfer("a", token)
    assert a.state is RequestState.WAITING and t.num_waiting == 2
    assert t.begin_transfer("a", a.transfer_token) is a


# ---- prefix cache ----------------------------------------------------------------------------


def cached_table(num_blocks: int = 10) -> RequestTable:
    return RequestTable(BlockPool(num_blocks), block_size=4, max_requests=8, prefix_caching=True)


def run_to_end(t: RequestTable, rid: str, prompt: list[int], written: list[int]) -> list[int]:
    r = t.admit(rid, prompt, params(8), lease_ms=1000, now=0.0)
    t.begin_transfer(rid, r.transfer_token)
    assert t.start_running(r)
    t.finish(r, written)
    return r.block_table


def test_a_finished_request_leaves_its_written_blocks_for_the_next_prompt() -> None:
    t = cached_table()
    prompt = list(range(10))
    output = [50, 51, 52, 53, 54]  # K/V written for prompt + 4 outputs: 14 tokens, 3 full blocks
    table_a = run_to_end(t, "a", prompt, prompt + output[:-1])
    assert table_a == [0, 1, 2, 3, 4]  # 10 + 8 - 1 positions
    assert t.num_free_blocks == 10  # cached blocks no request holds count as free

    second = prompt + output + [7, 7, 7]  # 18 tokens: blocks 0-2 cached, 3-4 new
    b = t.admit("b", second, params(2), lease_ms=1000, now=0.0)
    assert b.num_cached_blocks == 3
    assert b.block_table[:3] == [0, 1, 2] and b.block_table[3] not in table_a[:3]
    assert b.prompt_block_ids == b.block_table[:5]
    assert b.received_block_ids == b.block_table[3:5]
    assert t.prefix_cache_reading().hit_tokens == 12


def test_a_prompt_never_reuses_the_block_of_its_last_token() -> None:
    t = cached_table()
    prompt = list(range(8))
    run_to_end(t, "a", prompt, [*prompt, 99, 98, 97, 96])  # 12 written: 3 full blocks
    b = t.admit("b", prompt, params(1), lease_ms=1000, now=0.0)
    assert b.num_cached_blocks == 1  # block 1 holds token 7, the last: prefill sends it


def test_a_request_that_never_ran_caches_nothing() -> None:
    t = cached_table()
    r = t.admit("a", list(range(8)), params(4), lease_ms=1000, now=0.0)
    assert t.cancel(r)
    t.finish(r, list(range(8)))  # late and ignored: it was never RUNNING
    assert t.prefix_cache_reading().cached_blocks == 0 and t.num_free_blocks == 10


def test_cached_blocks_are_evicted_when_admission_needs_them() -> None:
    t = cached_table(num_blocks=4)
    run_to_end(t, "a", list(range(8)), list(range(12)))  # 3 full blocks cached
    r = t.admit("b", [5] * 13, params(1), lease_ms=1000, now=0.0)  # 4 blocks
    assert r.num_cached_blocks == 0 and sorted(r.block_table) == [0, 1, 2, 3]
    assert t.prefix_cache_reading() == (0, 8 + 13, 0, 3, True)
    with pytest.raises(ResourceExhausted, match="0 of 4 free"):
        t.admit("c", [1], params(1), lease_ms=1000, now=0.0)


def test_room_held_counts_the_waiting_requests_cached_blocks_too() -> None:
    """The held room counted only the blocks the waiting request lacked, not its cached prefix:
    another request could take what left it one short again, and again (found under load
    with two frontends: a 60-block request, 2 of them cached, waited out its deadline)."""
    t = cached_table(num_blocks=8)
    run_to_end(t, "warm", list(range(8)), list(range(8)))  # tokens 0..7 cached: 2 blocks
    other = t.admit("other", [9] * 5, params(8), lease_ms=1000, now=0.0)  # 3 blocks
    big = list(range(8)) + [7] * 12  # + max_tokens 5: 6 blocks, 2 of them cached
    with pytest.raises(ResourceExhausted, match="needs 6"):
        t.admit("big", big, params(5), lease_ms=1000, now=0.0)
    t.cancel(other)  # 8 available (the 2 cached among them): 4 blocks would leave it 4 of 6
    with pytest.raises(ResourceExhausted, match="6 are held"):
        t.admit("small", [5] * 9, params(8), lease_ms=1000, now=0.5)
    admitted = t.admit("big", big, params(5), lease_ms=1000, now=1.0)
    assert (len(admitted.block_table), admitted.num_cached_blocks) == (6, 2)


def running(t: RequestTable, request_id: str, prompt: list[int], max_tokens: int) -> DecodeRequest:
    r = t.admit(request_id, prompt, params(max_tokens), lease_ms=1000, now=0.0)
    t.begin_transfer(request_id, r.transfer_token)
    assert t.start_running(r)
    return r


def test_admission_reserves_the_first_outputs_and_a_running_table_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(block_pool, "ADMISSION_OUTPUT_TOKENS", 4)
    t = table(num_blocks=6)
    a = running(t, "a", [1] * 5, 16)  # 5 + 4 - 1 positions at admission: 2 blocks, not 5
    assert a.block_table == [0, 1] and t.num_free_blocks == 4
    same = a.block_table
    assert t.grow(a, 8) and a.block_table == [0, 1]  # covered: nothing taken
    assert t.grow(a, 9) and a.block_table == [0, 1, 2]
    assert a.block_table is same  # in place: the running sequence holds this list
    assert not t.grow(a, 100) and a.block_table == [0, 1, 2]  # all or nothing
    with pytest.raises(InvalidArgument, match="need 7 KV blocks, more than this decode"):
        t.admit("long", [1] * 5, params(21), lease_ms=1000, now=0.0)  # 25 positions


def test_a_preempted_request_gives_its_blocks_back_and_holds_admission_until_it_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(block_pool, "ADMISSION_OUTPUT_TOKENS", 4)
    t = cached_table()
    prompt = list(range(10))
    a = running(t, "a", prompt, 20)  # 13 positions: blocks 0-3
    written = [*prompt, 50, 51, 52]  # 13 tokens' K/V: 3 full blocks
    assert t.preempt(a, written) == 4
    assert (a.block_table, a.is_preempted, t.num_preempted) == ([], True, 1)
    assert t.num_free_blocks == 10 and t.num_running == 0  # out of the batch, its blocks back
    with pytest.raises(ResourceExhausted, match="1 preempted request waits for blocks first"):
        t.admit("b", [9] * 4, params(2), lease_ms=1000, now=0.0)
    assert t.resume(a, written, spare_blocks=7) is None  # 4 needed + 7 spare > 10
    assert t.num_free_blocks == 10 and t.num_preempted == 1  # nothing taken
    assert t.resume(a, written, spare_blocks=6) == 12  # its 3 full blocks were still cached
    assert a.block_table[:3] == [0, 1, 2] and len(a.block_table) == 4  # 14 positions
    assert (a.is_preempted, t.num_preempted, t.num_free_blocks) == (False, 0, 6)
    t.admit("b", [9] * 4, params(2), lease_ms=1000, now=0.0)
    assert t.preempt(a, written) == 4
    t.cancel(a)
    t.finish(a)  # ended while preempted: no block to give back twice
    assert (t.num_preempted, t.num_running, t.num_free_blocks) == (0, 0, 8)  # b holds 2
