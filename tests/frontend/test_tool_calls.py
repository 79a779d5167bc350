"""ToolCallParser on top of ReasoningSplitter: Qwen3's <tool_call> blocks become structured calls,
never content, however the text is cut into deltas (every cut into two and three pieces)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest

from services.frontend.reasoning import ReasoningSplitter
from services.frontend.tool_calls import ParsedDelta, ToolCallDelta, ToolCallParser, new_call_id

PARIS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
TOKYO = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "東京"}}\n</tool_call>'
MALFORMED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'

CALL_PARIS = ("get_weather", '{"city": "Paris", "days": 2}')
CALL_TOKYO = ("get_time", '{"zone": "東京"}')

CASES = {
    # name: (generated text, reasoning, content, calls as (name, arguments))
    "one_call": (PARIS, "", "", [CALL_PARIS]),
    "two_calls": (PARIS + "\n" + TOKYO, "", "", [CALL_PARIS, CALL_TOKYO]),
    "content_then_call": ("Let me check.\n" + PARIS, "", "Let me check.", [CALL_PARIS]),
    "think_then_call": (
        "<think>\nI need the weather.\n</think>\n\n" + PARIS + "\n",
        "I need the weather.",
        "",
        [CALL_PARIS],
    ),
    "think_content_two_calls": (
        "<think>\nBoth.\n</think>\n\nChecking both.\n" + PARIS + "\n" + TOKYO,
        "Both.",
        "Checking both.",
        [CALL_PARIS, CALL_TOKYO],
    ),
    # not JSON: the block is content, tags and all (as vLLM does)
    "malformed": (MALFORMED, "", MALFORMED, []),
    "malformed_then_call": (
        "Try:\n" + MALFORMED + "\n" + TOKYO,
        "",
        "Try:\n" + MALFORMED,
        [CALL_TOKYO],
    ),
    # JSON, but not a call (no name; arguments not an object)
    "not_a_call": (
        '<tool_call>\n{"arguments": {}}\n</tool_call> and <tool_call>{"name": "f", '
        '"arguments": 3}</tool_call>',
        "",
        '<tool_call>\n{"arguments": {}}\n</tool_call> and <tool_call>{"name": "f", '
        '"arguments": 3}</tool_call>',
        [],
    ),
    # content after a call is kept; the newline framing the block is not
    "call_then_content": (PARIS + "\n\nDone.\n", "", "Done.\n", [CALL_PARIS]),
    # cut off before </tool_call> (max_tokens, or the model stopped): a call if the JSON parses
    "unclosed_call": (PARIS[: -len("</tool_call>")], "", "", [CALL_PARIS]),
    "unclosed_garbage": (
        '<tool_call>\n{"name": "f", "argu',
        "",
        '<tool_call>\n{"name": "f", "argu',
        [],
    ),
    # text that only looks like a tag stays text, whitespace included
    "no_tags": (
        "a <tool_cal b </tool_call x <tool_c",
        "",
        "a <tool_cal b </tool_call x <tool_c",
        [],
    ),
    "plain_answer": ("Hello,\n\n  world.\n\n", "", "Hello,\n\n  world.\n\n", []),
    # a missing "arguments" means none
    "no_arguments": ('<tool_call>{"name": "ping"}</tool_call>', "", "", [("ping", "{}")]),
    # the closing tag inside an argument's string (code, markup, an escaped quote before it)
    # is the argument's text: the call stays whole, then the block closes at the real tag
    "tag_in_an_argument": (
        '<tool_call>\n{"name": "write", "arguments": {"text": "a \\"</tool_call>\\" b"}}\n'
        "</tool_call>\nDone.",
        "",
        "Done.",
        [("write", '{"text": "a \\"</tool_call>\\" b"}')],
    ),
    # both tags inside one argument (code that splits on them): still one call
    "tags_in_code_argument": (
        '<tool_call>\n{"name": "run", "arguments": {"code": '
        "\"s.split('</tool_call>')[0].split('<tool_call>')[1]\"}}\n</tool_call>",
        "",
        "",
        [("run", "{\"code\": \"s.split('</tool_call>')[0].split('<tool_call>')[1]\"}")],
    ),
    # a string never closed (a path ending in a backslash): the block ends at its first
    # closing tag once another block opens after it, and the next call is still a call
    "unclosed_string_then_call": (
        '<tool_call>\n{"name": "ls", "arguments": {"path": "C:\\"}}\n</tool_call>\n'
        + TOKYO
        + " Done.",
        "",
        '<tool_call>\n{"name": "ls", "arguments": {"path": "C:\\"}}\n</tool_call>\nDone.',
        [CALL_TOKYO],
    ),
    # content between and after calls stays parted from the content before them by the first
    # block's framing (it was glued: "Paris.Then Rome.Done.")
    "content_between_calls": (
        "I will check Paris.\n" + PARIS + "\nThen Tokyo.\n" + TOKYO + "\n\nDone. ",
        "",
        "I will check Paris.\nThen Tokyo.\nDone. ",
        [CALL_PARIS, CALL_TOKYO],
    ),
    "content_after_two_calls": (
        "Both: " + PARIS + "\n" + TOKYO + "\n Done.",
        "",
        "Both: Done.",
        [CALL_PARIS, CALL_TOKYO],
    ),
    "malformed_after_a_call": (
        "First.\n" + PARIS + "\n" + MALFORMED,
        "",
        "First.\n" + MALFORMED,
        [CALL_PARIS],
    ),
    # JSON that Python reads but the next turn could not send back: not a call
    "not_json_numbers": (
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": {"y": 1e400}}</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": {"z": "\\ud800"}}</tool_call>',
        "",
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": {"y": 1e400}}</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": {"z": "\\ud800"}}</tool_call>',
        [],
    ),
}


def _counter() -> Callable[[], str]:
    ids = itertools.count()
    return lambda: f"call_{next(ids)}"


def _stream(pieces: list[str]) -> tuple[str, list[str], list[ToolCallDelta]]:
    """Run pieces through the splitter then the parser, as the frontend does; returns the
    reasoning, every content delta, and the calls."""
    splitter, parser = ReasoningSplitter(), ToolCallParser(_counter())
    reasoning: list[str] = []
    deltas: list[ParsedDelta] = []
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning.append(r)
        deltas.append(parser.push(c))
    r, c = splitter.finish()
    reasoning.append(r)
    deltas.append(parser.push(c))
    deltas.append(parser.finish())
    calls = [call for d in deltas for call in d.tool_calls]
    assert parser.num_calls == len(calls)
    return "".join(reasoning), [d.content for d in deltas], calls


def _expected_calls(calls: list[tuple[str, str]]) -> list[ToolCallDelta]:
    return [ToolCallDelta(i, f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]


def _check(pieces: list[str], reasoning: str, content: str, calls: list) -> None:
    got_reasoning, deltas, got_calls = _stream(pieces)
    assert (got_reasoning, "".join(deltas), got_calls) == (
        reasoning,
        content,
        _expected_calls(calls),
    ), pieces
    if OPEN_TAG not in content:
        assert not any("<tool_call>" in d or "</tool_call>" in d for d in deltas), deltas


OPEN_TAG = "<tool_call>"


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_text(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    _check([text], reasoning, content, calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_cut_in_two_and_three_gives_the_same_result(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    n = len(text)
    for i in range(n + 1):
        _check([text[:i], text[i:]], reasoning, content, calls)
    for i, j in itertools.combinations(range(1, n), 2):
        _check([text[:i], text[i:j], text[j:]], reasoning, content, calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_character_at_a_time(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    _check(list(text), reasoning, content, calls)


def test_no_tag_or_json_in_any_content_delta() -> None:
    """What a streaming client sees, a character at a time: the text before the call, then
    nothing of the block; the call arrives whole in the delta that closes its block."""
    text = "Checking.\n" + PARIS + "\n" + TOKYO
    parser = ToolCallParser(_counter())
    seen: list[ParsedDelta] = [parser.push(ch) for ch in text] + [parser.finish()]
    assert "".join(d.content for d in seen) == "Checking."
    for d in seen:
        assert "<" not in d.content and "{" not in d.content and "name" not in d.content
    closing = [i for i, d in enumerate(seen) if d.tool_calls]
    assert closing == [len("Checking.\n" + PARIS) - 1, len(text) - 1]


def test_arguments_are_valid_json_in_the_order_written() -> None:
    parser = ToolCallParser()
    out = parser.push('<tool_call>{"name":"f","arguments":{"b":1,"a":[1.0,"é"]}}</tool_call>')
    (call,) = out.tool_calls
    assert call.arguments == '{"b": 1, "a": [1.0, "é"]}'
    assert json.loads(call.arguments) == {"b": 1, "a": [1.0, "é"]}
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24


def test_ids_differ_between_calls() -> None:
    assert len({new_call_id() for _ in range(100)}) == 100
