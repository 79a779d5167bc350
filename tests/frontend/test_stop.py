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
    """One character at a time: the first character that completes a stop string ends the
    text before that stop (the longer of two it completes)."""
    for end in range(1, len(text) + 1):
        done = [len(s) for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(done)], True
    return text, False


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
    # "abcd" starts first, but "bc" is complete first: a stream of one character at a time
    # would have stopped there, so any cut does.
    assert run(["bc", "abcd"], ["xab", "cd"]) == ("xa", True)
    assert run(["bc", "abcd"], ["xabcd"]) == ("xa", True)
    assert run(["\nUser:", "User"], ["Hi\nUser: x"]) == run(
        ["\nUser:", "User"], list("Hi\nUser: x")
    )
    assert run(["abc", "bc"], ["xabc"]) == ("x", True)  # completed together: the longer


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


@pytest.mark.parametrize("seed", range(200))
def test_overlapping_stops_match_as_one_character_at_a_time(seed: int) -> None:
    """Stops that overlap each other (two letters, several stops): the same result for the
    whole text, one character a delta, and random cuts."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(30))
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 6))) for _ in range(3)]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 12)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    expected = reference(stops, text)
    assert run(stops, [text]) == run(stops, list(text)) == run(stops, deltas) == expected


def test_before_min_tokens_nothing_matches_nor_is_held() -> None:
    """min_tokens: text pushed with may_stop False goes out whole, stop strings and their
    starts included; matching begins with the text pushed after."""
    m = StopMatcher(["END"])
    assert m.push("xEND yE", may_stop=False) == ("xEND yE", False)
    assert m.held == ""
    assert m.push("ND z", may_stop=True) == ("ND z", False)  # "E" went out before: no match
    assert m.push(" END!", may_stop=True) == (" ", True)
