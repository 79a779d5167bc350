"""Routing choices: most free decode blocks, least queued prefill tokens, compatible pairs only."""

from __future__ import annotations

import pytest

from mili.errors import FailedPrecondition, Unavailable
from services.frontend.router import Route, Router, State

P0, P1 = "p0:1", "p1:1"
D0, D1 = "d0:1", "d1:1"


def router(free: dict[str, int] | None = None, queued: dict[str, int] | None = None) -> Router:
    r = Router([P0, P1], [D0, D1])
    for address, n in (queued or {P0: 0, P1: 0}).items():
        r.update_prefill(address, num_queued_tokens=n, max_prompt_tokens=4096)
    for address, n in (free or {D0: 100, D1: 100}).items():
        r.update_decode(address, num_free_blocks=n, num_total_blocks=100, max_context_tokens=4096)
    for p in r.prefills:
        for d in r.decodes:
            r.set_pair_error(p, d, None)
    return r


def test_decode_with_most_free_blocks_and_prefill_with_least_queue() -> None:
    r = router(free={D0: 10, D1: 50}, queued={P0: 300, P1: 20})
    assert r.candidates() == [Route(P1, D1), Route(P1, D0)]


def test_routed_work_counts_until_the_next_poll() -> None:
    r = router(free={D0: 50, D1: 45}, queued={P0: 0, P1: 10})
    first = r.candidates()[0]
    assert first == Route(P0, D0)
    r.start(first, num_prompt_tokens=100, num_blocks=7)  # D0: 43 left, P0: 100 queued
    assert r.candidates()[0] == Route(P1, D1)
    # A poll replaces the estimate with what the instance reports.
    r.update_decode(D0, num_free_blocks=50, num_total_blocks=100, max_context_tokens=4096)
    r.update_prefill(P0, num_queued_tokens=0, max_prompt_tokens=4096)
    assert r.candidates()[0] == Route(P0, D0)


def test_ties_go_to_fewest_in_flight_then_longest_ago() -> None:
    r = router()
    routes = []
    for _ in range(4):
        route = r.candidates()[0]
        ticket = r.start(route, num_prompt_tokens=1, num_blocks=0)
        r.finish(ticket)
        routes.append(route)
    assert [x.decode for x in routes] == [D0, D1, D0, D1]  # sequential requests alternate
    assert [x.prefill for x in routes] == [P0, P1, P0, P1]
    busy = r.start(Route(P0, D0), num_prompt_tokens=0, num_blocks=0)
    assert r.candidates()[0] == Route(P1, D1)
    r.finish(busy)


def test_refused_requests_do_not_count_against_the_instance() -> None:
    r = router(free={D0: 50, D1: 45})
    ticket = r.start(Route(P0, D0), num_prompt_tokens=10, num_blocks=20)
    r.finish(ticket, is_refused=True)
    assert r.decodes[D0].free_estimate == 50
    assert r.decodes[D0].num_in_flight == 0


def test_down_instances_are_skipped_and_all_down_is_unavailable() -> None:
    r = router(free={D0: 90, D1: 10})
    r.mark_down(D0)
    assert [x.decode for x in r.candidates()] == [D1]
    r.mark_down(D1)
    with pytest.raises(Unavailable, match="no decode instance"):
        r.candidates()
    r = router()
    r.mark_down(P0)
    r.mark_down(P1)
    with pytest.raises(Unavailable, match="no prefill instance"):
        r.candidates()


def test_excluded_decodes_are_skipped() -> None:
    r = router(free={D0: 90, D1: 10})
    assert [x.decode for x in r.candidates(exclude={D0})] == [D1]
    assert r.candidates(exclude={D0, D1}) == []


def test_incompatible_pairs_are_never_routed() -> None:
    r = router(queued={P0: 0, P1: 1000})
    r.set_pair_error(P0, D0, "layouts differ: P0 vs D0")
    # D0 still reachable through P1, D1 through either (P0 preferred: shorter queue)
    assert r.candidates() == [Route(P1, D0), Route(P0, D1)]
    r.set_pair_error(P1, D0, "layouts differ: P1 vs D0")
    assert r.candidates() == [Route(P0, D1)]


def test_no_compatible_pair_is_failed_precondition_with_the_layouts() -> None:
    r = Router([P0], [D0])
    r.update_prefill(P0, num_queued_tokens=0, max_prompt_tokens=4096)
    r.update_decode(D0, num_free_blocks=1, num_total_blocks=1, max_context_tokens=4096)
    r.set_pair_error(P0, D0, "prefill has [block_size=16], decode has [block_size=32]")
    with pytest.raises(FailedPrecondition, match=r"block_size=16.*block_size=32"):
        r.candidates()
    r.set_pair_error(P0, D0, None)  # fixed (an instance restarted with the right layout)
    assert r.candidates() == [Route(P0, D0)]


def test_unchecked_pairs_are_not_routed() -> None:
    r = Router([P0], [D0])
    r.update_prefill(P0, num_queued_tokens=0, max_prompt_tokens=4096)
    r.update_decode(D0, num_free_blocks=1, num_total_blocks=1, max_context_tokens=4096)
    with pytest.raises(Unavailable, match="checked"):
        r.candidates()


def test_context_is_the_smallest_among_up_decodes() -> None:
    r = Router([P0], [D0, D1])
    assert r.max_context_tokens is None
    r.update_decode(D0, num_free_blocks=1, num_total_blocks=1, max_context_tokens=4096)
    r.update_decode(D1, num_free_blocks=1, num_total_blocks=1, max_context_tokens=2048)
    assert r.max_context_tokens == 2048
    r.mark_down(D1)
    assert r.max_context_tokens == 4096


def test_route_problem_says_why_nothing_is_routable() -> None:
    r = router()
    assert r.route_problem() is None
    r.mark_down(D0)
    assert r.route_problem() is None  # D1 still pairs
    r.mark_down(D1)
    assert r.route_problem() == f"no decode instance is up (of {D0}, {D1})"
    r.update_decode(D1, num_free_blocks=9, num_total_blocks=9, max_context_tokens=64)
    r.mark_down(P0)
    r.mark_down(P1)
    assert r.route_problem() == f"no prefill instance is up (of {P0}, {P1})"
    r.update_prefill(P1, num_queued_tokens=0, max_prompt_tokens=64)
    r.set_pair_error(P1, D1, "block_size=16 vs block_size=32")
    assert (
        r.route_problem()
        == "no up prefill/decode pair is compatible (see the frontend's REFUSING PAIR errors)"
    )
    r.set_pair_error(P1, D1, None)
    assert r.route_problem() is None


# ---- membership: instances found by DNS come and go ------------------------------------------

P2, D2 = "p2:1", "d2:1"


def test_new_members_join_down_and_route_once_their_info_and_pairs_are_in() -> None:
    r = router()
    changes = r.set_members([P0, P1], [D0, D1, D2])
    assert changes.added == [D2] and not changes.dropped and not changes.draining
    assert r.decodes[D2].is_up is False
    assert [x.decode for x in r.candidates()] == [D0, D1]  # D2 not yet
    r.update_decode(D2, num_free_blocks=500, num_total_blocks=500, max_context_tokens=4096)
    assert [x.decode for x in r.candidates()] == [D0, D1]  # up, but no pair checked yet
    r.set_pair_error(P0, D2, None)
    assert r.candidates()[0] == Route(P0, D2)


def test_vanished_idle_members_are_dropped_at_once_with_their_pairs() -> None:
    r = router()
    changes = r.set_members([P0], [D1])
    assert changes.dropped == [P1, D0] and not changes.draining
    assert list(r.prefills) == [P0] and list(r.decodes) == [D1]
    assert r.candidates() == [Route(P0, D1)]
    assert r.pair_error(P1, D1) is None and not r.is_compatible(P1, D1)
    # Back later: a new member, routed only after a fresh check.
    assert r.set_members([P0, P1], [D0, D1]).added == [P1, D0]
    assert not r.is_compatible(P1, D0)


def test_vanished_busy_members_drain_then_drop_when_their_last_request_ends() -> None:
    r = router(free={D0: 90, D1: 10})
    first = r.start(Route(P0, D0), num_prompt_tokens=5, num_blocks=1)
    second = r.start(Route(P0, D0), num_prompt_tokens=5, num_blocks=1)
    changes = r.set_members([P0, P1], [D1])
    assert changes.draining == [D0] and not changes.dropped
    assert r.decodes[D0].is_draining
    # No new request goes to D0, though it has the most free blocks.
    assert [x.decode for x in r.candidates()] == [D1]
    assert [(m.address, m.state, m.num_in_flight) for m in r.members() if m.kind == "decode"] == [
        (D0, State.DRAINING, 2),
        (D1, State.UP, 0),
    ]
    r.finish(first)
    assert D0 in r.decodes and r.take_dropped() == []
    r.finish(second)  # the last one: dropped now
    assert D0 not in r.decodes
    assert r.take_dropped() == [D0]
    assert r.take_dropped() == []


def test_a_draining_member_that_comes_back_serves_again() -> None:
    r = router(free={D0: 90, D1: 10})
    ticket = r.start(Route(P1, D0), num_prompt_tokens=5, num_blocks=1)
    assert r.set_members([P0], [D0, D1]).draining == [P1]
    assert [x.prefill for x in r.candidates()] == [P0, P0]
    changes = r.set_members([P0, P1], [D0, D1])
    assert changes.returned == [P1] and not changes.added
    assert r.prefills[P1].is_draining is False
    r.finish(ticket)
    assert P1 in r.prefills and r.take_dropped() == []


def test_no_members_yet_says_so() -> None:
    r = Router()
    assert r.route_problem() == (
        "no decode instance is up (of none known: discovery found no instance)"
    )
    with pytest.raises(Unavailable, match="none known"):
        r.candidates()
    r.set_members([P0], [D0])
    assert r.route_problem() == f"no decode instance is up (of {D0})"
    assert [(m.kind, m.address, m.state) for m in r.members()] == [
        ("prefill", P0, State.DOWN),
        ("decode", D0, State.DOWN),
    ]


def test_an_info_answer_for_a_dropped_member_is_ignored() -> None:
    r = router()
    r.set_members([P0], [D0])
    r.update_decode(D1, num_free_blocks=1, num_total_blocks=1, max_context_tokens=1)
    r.update_prefill(P1, num_queued_tokens=0, max_prompt_tokens=1)
    r.set_pair_error(P1, D1, None)
    assert list(r.decodes) == [D0] and list(r.prefills) == [P0]
    assert not r.is_compatible(P1, D1)


# ---- prefix affinity -------------------------------------------------------------------------


def test_the_instances_holding_the_longest_prefix_go_first() -> None:
    r = router(free={D0: 90, D1: 50}, queued={P0: 0, P1: 100})
    assert r.candidates()[0] == Route(P0, D0)  # by load alone
    affinity = {D1: 3, D0: 1, P1: 4}
    assert r.candidates(affinity=affinity) == [Route(P1, D1), Route(P1, D0)]


def test_affinity_yields_to_load_past_the_slack() -> None:
    r = router(free={D0: 90, D1: 90})
    r.affinity_slack_requests = 2
    r.affinity_slack_tokens = 1000
    affinity = {D1: 5, P1: 5}
    tickets = [r.start(Route(P1, D1), num_prompt_tokens=400, num_blocks=1) for _ in range(3)]
    # D1 has 3 in flight, D0 none: past the slack of 2; P1 has 1200 tokens queued: past 1000
    assert r.candidates(affinity=affinity)[0] == Route(P0, D0)
    r.finish(tickets.pop())  # D1: 2 in flight, within the slack again
    assert r.candidates(affinity=affinity)[0] == Route(P0, D1)  # P1's tokens count until a poll
    r.update_prefill(P1, num_queued_tokens=800, max_prompt_tokens=4096)
    assert r.candidates(affinity=affinity)[0] == Route(P1, D1)
    # a decode without room for the request is not preferred either
    assert r.candidates(affinity=affinity, blocks_needed_on=lambda _: 89)[0].decode == D0


def test_an_instance_that_goes_down_loses_its_prefixes() -> None:
    r = router()
    keys = r.prefix_index.keys(list(range(32)))
    r.prefix_index.record(D1, keys, now=0.0)
    r.prefix_index.record(D0, keys[:1], now=0.0)
    r.mark_down(D1)
    assert r.prefix_index.matches(keys, now=1.0) == {D0: 1}


# ---- room: instances that turned a request away for capacity ----------------------------------


def test_a_full_instance_is_skipped_until_its_next_info_or_a_request_leaving_it() -> None:
    r = router(free={D0: 50, D1: 45}, queued={P0: 0, P1: 10})
    r.mark_full(D0, "d0 full", seen_clock=r.room_clock(D0))
    r.mark_full(P0, "p0 full", seen_clock=r.room_clock(P0))
    assert r.full_instances() == {P0: "p0 full", D0: "d0 full"}
    assert r.candidates(skip_full=True) == [Route(P1, D1)]
    assert r.candidates() == [Route(P0, D0), Route(P0, D1)]  # without skip_full: as before
    r.update_prefill(P0, num_queued_tokens=0, max_prompt_tokens=4096)  # its next Info
    assert r.candidates(skip_full=True) == [Route(P0, D1)]
    ticket = r.start(Route(P0, D1), num_prompt_tokens=1, num_blocks=1)
    r.finish(ticket, is_refused=True)  # a refusal frees nothing there
    r.finish(r.start(Route(P1, D0), num_prompt_tokens=1, num_blocks=1))  # one of ours left D0
    assert r.full_instances() == {}
    r.mark_full(P1, "p1 full", seen_clock=r.room_clock(P1))
    r.mark_room(P1)  # e.g. a prefill call of ours on it ended
    assert r.full_instances() == {}


def test_a_refusal_asked_before_room_freed_does_not_mark_the_instance_full() -> None:
    r = router()
    seen = r.room_clock(D0)
    r.finish(r.start(Route(P0, D0), num_prompt_tokens=1, num_blocks=1))  # left meanwhile
    r.mark_full(D0, "d0 full", seen_clock=seen)
    assert r.full_instances() == {}
    r.mark_full(D0, "d0 full", seen_clock=r.room_clock(D0))
    assert r.full_instances() == {D0: "d0 full"}
    r.mark_full("gone:1", "dropped meanwhile", seen_clock=0)  # ignored


def test_every_candidate_full_is_no_route_not_an_error() -> None:
    r = router()
    for address in (D0, D1):
        r.mark_full(address, f"{address} full", seen_clock=r.room_clock(address))
    assert r.candidates(skip_full=True) == []
    r.update_decode(D1, num_free_blocks=9, num_total_blocks=100, max_context_tokens=4096)
    for address in (P0, P1):  # every prefill full: no route through any decode either
        r.mark_full(address, f"{address} full", seen_clock=r.room_clock(address))
    assert r.candidates(skip_full=True) == []
    r.set_pair_error(P0, D0, "layouts differ")
    r.set_pair_error(P1, D0, "layouts differ")
    r.set_pair_error(P0, D1, "layouts differ")
    r.set_pair_error(P1, D1, "layouts differ")
    with pytest.raises(FailedPrecondition):  # nothing compatible: full or not
        r.candidates(skip_full=True)
