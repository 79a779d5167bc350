"""The stop-string matcher: matches across deltas, holds back partial matches, unicode."""

from __future__ import annotations

import random

import pytest

from services.frontend.stop import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for delta in deltas:
        pushed = matcher.push(delta)
        out.append(pushed.text)
        if pushed.is_stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def test_no_stops_passes_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_match_inside_one_delta_cuts_before_it() -> None:
    assert run(["STOP"], ["hello STOP world"]) == ("hello ", True)


def test_match_across_deltas() -> None:
    assert run(["\nUser:"], ["Hi there\nU", "se", "r: what"]) == ("Hi there", True)


def test_partial_match_is_held_back_then_released() -> None:
    matcher = StopMatcher(["\nUser:"])
    assert matcher.push("Hi there\nUs") == ("Hi there", False)
    assert matcher.held == "\nUs"
    assert matcher.push("ed it") == ("\nUsed it", False)
    assert matcher.held == ""


def test_held_text_is_flushed_at_the_end() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.push("the EN") == ("the ", False)
    assert matcher.flush() == "EN"


def test_earliest_match_wins_among_several_stops() -> None:
    assert run(["world", "lo w"], ["hel", "lo world"]) == ("hel", True)
    assert run(["bc", "abcd"], ["xab", "cd"]) == ("x", True)  # "abcd" starts first


def test_multichar_unicode_across_deltas() -> None:
    assert run(["🙂👍"], ["好的 🙂", "👍 更多"]) == ("好的 ", True)
    deltas = ["服务器会很快回答", "。", "今", "天天气很好"]
    assert run(["。今天"], deltas) == ("服务器会很快回答", True)
    # a near miss of a multi-code-point stop releases everything
    assert run(["👩‍👩‍👧"], ["family 👩‍👩", "‍👦!"]) == ("family 👩‍👩‍👦!", False)


def test_stop_at_the_very_start() -> None:
    assert run(["abc"], ["a", "b", "c", "more"]) == ("", True)


def test_push_after_stop_is_an_error() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.push("ax").is_stopped
    with pytest.raises(RuntimeError):
        matcher.push("more")


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_equal_matching_the_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab🙂é "
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(stops, deltas) == reference(stops, text)


def test_before_min_tokens_nothing_matches_nor_is_held() -> None:
    """min_tokens: text pushed with may_stop False goes out whole, stop strings and their
    starts included; matching begins with the text pushed after."""
    m = StopMatcher(["END"])
    assert m.push("xEND yE", may_stop=False) == ("xEND yE", False)
    assert m.held == ""
    assert m.push("ND z", may_stop=True) == ("ND z", False)  # "E" went out before: no match
    assert m.push(" END!", may_stop=True) == (" ", True)
