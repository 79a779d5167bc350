"""One chat output splitter for both APIs: recorded generations cut every way give the same
reasoning, answer and calls; the gRPC responses (convert.py) carry them; tools and tool choices
are checked at the edge naming the field."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest

from mili.engine.constraint.spec import Constraint
from mili.engine.stop import FinishReason
from mili.errors import InvalidArgument
from mili.pb.common.v1 import chat_pb2
from mili.pb.frontend.v1 import generation_pb2
from services.frontend import convert
from services.frontend.chat_output import ChatOutput
from services.frontend.pipeline import Delta
from services.frontend.tools import FunctionTool, ToolCallInput, ToolChoice
from services.frontend.validation import ChatTurn, Limits, RequestInput, SamplingInput, validate

# What Qwen3 writes when it thinks, then calls two tools (a block cut anywhere must not leak).
CALLING = (
    "<think>\nNeed the weather.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
CALLS = [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
WEATHER = FunctionTool("get_weather", "", '{"type": "object", "properties": {}}')


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


def run(output: ChatOutput, parts: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning, content, calls = "", "", []
    for i, part in enumerate(parts):
        piece = output.push(part, is_last=i == len(parts) - 1)
        reasoning += piece.reasoning
        content += piece.content
        calls += [(c.name, c.arguments) for c in piece.tool_calls]
    return reasoning, content, calls


def cuts(text: str, step: int = 2) -> Iterator[list[str]]:
    for a in range(0, len(text) + 1, step):
        for b in range(a, len(text) + 1, 7):
            yield [text[:a], text[a:b], text[b:]]


def test_every_cut_gives_the_same_reasoning_answer_and_calls() -> None:
    for parts in cuts(CALLING):
        output = ChatOutput(is_parsing_tools=True)
        assert run(output, parts) == ("Need the weather.", "Let me check.", CALLS), parts
        assert output.num_calls == 2
        assert output.finish_reason(FinishReason.STOP) == "tool_calls"
        assert output.finish_reason(FinishReason.LENGTH) == "length"


def test_parallel_tool_calls_false_returns_the_first_call_only() -> None:
    """Under tool_choice auto nothing in the sampling stops a second call: the answer holds
    the first, as vLLM answers it (it once held both), however the text is cut."""
    for parts in cuts(CALLING, step=5):
        output = ChatOutput(is_parsing_tools=True, is_parallel=False)
        assert run(output, parts) == ("Need the weather.", "Let me check.", CALLS[:1]), parts
        assert output.finish_reason(FinishReason.STOP) == "tool_calls"


def test_a_forced_call_cut_short_is_dropped_not_content() -> None:
    """Under tool_choice required or named the answer can only be calls: one cut by max_tokens
    is neither a call nor content (its '<tool_call>' and half JSON were the answer's text),
    however the text is cut; the calls before it stay. Under auto the cut block stays text."""
    cut = CALLING[: CALLING.rindex('"now"') + 3]
    for parts in cuts(cut, step=3):
        output = ChatOutput(is_parsing_tools=True, is_forced=True)
        assert run(output, parts) == ("Need the weather.", "Let me check.", CALLS[:1]), parts
        assert output.finish_reason(FinishReason.LENGTH) == "length"
    first = '<tool_call>\n{"name": "get_we'
    for parts in cuts(first, step=1):
        assert run(ChatOutput(is_parsing_tools=True, is_forced=True), parts) == ("", "", [])
        assert run(ChatOutput(is_parsing_tools=True), parts) == ("", first, [])


@pytest.mark.parametrize("fields", [{"constraint": "json"}, {"enable_thinking": False}])
def test_a_think_tag_is_answer_text_where_no_thinking_can_come(fields: dict[str, object]) -> None:
    """Under a constraint of the caller's only a think block at the start is thinking: the
    answer is its text (a JSON string holding "<think>" once came back cut into reasoning:
    invalid JSON); with thinking off all of it is. A forced tool choice's block is split."""
    sampling = SamplingInput(
        constraint=Constraint.json_object() if fields.get("constraint") else None
    )
    turns = (ChatTurn("user", "tag?"),)
    thinking = fields.get("enable_thinking")
    valid = validate(
        RequestInput(messages=turns, sampling=sampling, enable_thinking=thinking), Limits()
    )
    answer = '{"tag": "<think>", "note": "</think>"}'
    assert run(ChatOutput.of(valid), [answer[:12], answer[12:]]) == ("", answer, [])
    forced = validate(
        RequestInput(messages=turns, tools=(WEATHER,), tool_choice=ToolChoice("required")),
        Limits(),
    )
    assert run(ChatOutput.of(forced), [CALLING]) == ("Need the weather.", "Let me check.", CALLS)


def test_without_tools_blocks_stay_answer_text() -> None:
    output = ChatOutput(is_parsing_tools=False)
    reasoning, content, calls = run(output, [CALLING])
    assert reasoning == "Need the weather." and calls == []
    assert content.startswith("Let me check.\n<tool_call>\n{") and content.endswith("</tool_call>")
    assert output.finish_reason(FinishReason.STOP) == "stop"


def test_plain_text_passes_through_and_newlines_in_reasoning_wait() -> None:
    output = ChatOutput(is_parsing_tools=True)
    assert output.push("Hello") == ("", "Hello", [])
    assert output.push(" there ") == ("", " there", [])  # the blank may frame a block
    assert output.push("friend", is_last=True) == ("", " friend", [])
    thinking = ChatOutput(is_parsing_tools=False)
    assert thinking.push("<think>\nA\n") == ("A", "", [])
    assert thinking.push("B") == ("\nB", "", [])


# ---- the gRPC edge -----------------------------------------------------------------------------


def valid_chat(**fields: object) -> RequestInput:
    fields.setdefault("messages", (ChatTurn("user", "hi"),))
    return RequestInput(**fields)  # type: ignore[arg-type]


def test_grpc_responses_carry_reasoning_text_and_calls() -> None:
    deltas = [Delta([i], part) for i, part in enumerate([CALLING[:30], CALLING[30:90], ""])]
    deltas.append(Delta([9], CALLING[90:]))
    deltas[-1].finish_reason = FinishReason.STOP
    output = ChatOutput(True)
    streamed = [convert.generate_response("r", d, output) for d in deltas]
    assert "".join(r.reasoning_text for r in streamed) == "Need the weather."
    assert "".join(r.text for r in streamed) == "Let me check."
    calls = [(c.name, c.arguments) for r in streamed for c in r.tool_calls]
    assert calls == CALLS and len(streamed[-1].tool_calls) == 2  # both blocks close at the end
    assert streamed[-1].finish_reason == 1  # STOP: with tool_calls set, the answer is calls
    whole = convert.complete_response("r", deltas, ChatOutput(True))
    assert (whole.reasoning_text, whole.text) == ("Need the weather.", "Let me check.")
    assert [(c.name, c.arguments) for c in whole.tool_calls] == CALLS
    assert all(c.id.startswith("call_") for c in whole.tool_calls)
    prompt = convert.complete_response("r", deltas)  # not a chat: the text as generated
    assert prompt.text == CALLING and prompt.reasoning_text == "" and not prompt.tool_calls


def test_grpc_request_maps_tools_choice_and_turns_to_the_tokenizer() -> None:
    request = generation_pb2.GenerateRequest(
        messages=[
            chat_pb2.ChatMessage(role="user", content="weather?"),
            chat_pb2.ChatMessage(
                role="assistant",
                tool_calls=[chat_pb2.ToolCall(id="c1", name="get_weather", arguments="{}")],
            ),
            chat_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
        ],
        tools=[chat_pb2.Tool(name="get_weather", parameters=WEATHER.parameters)],
        tool_choice=generation_pb2.ToolChoice(
            mode=generation_pb2.TOOL_CHOICE_MODE_FUNCTION, function_name="get_weather"
        ),
        parallel_tool_calls=False,
    )
    given = convert.request_input(request, None)
    assert given.tools == (FunctionTool("get_weather", "", WEATHER.parameters),)
    assert given.tool_choice == ToolChoice("function", "get_weather")
    assert not given.parallel_tool_calls
    assert given.messages[1].tool_calls == (ToolCallInput("c1", "get_weather", "{}"),)
    assert given.messages[2].tool_call_id == "c1"
    valid = validate(given, Limits())
    assert valid.is_parsing_tools and valid.sampling.constraint is not None
    asked = convert.tokenize_request(valid)
    assert [t.name for t in asked.tools] == ["get_weather"]
    assert asked.messages[1].tool_calls[0].id == "c1" and asked.messages[2].tool_call_id == "c1"
    default = convert.request_input(generation_pb2.GenerateRequest(prompt="x"), None)
    assert default.tool_choice == ToolChoice("auto") and default.parallel_tool_calls
    unknown = generation_pb2.GenerateRequest(prompt="x", tool_choice=generation_pb2.ToolChoice())
    unknown.tool_choice.mode = 7  # a number the enum lacks: proto3 keeps it as sent
    with pytest.raises(InvalidArgument) as refused:
        convert.request_input(unknown, None)
    assert [v.field for v in refused.value.violations] == ["tool_choice.mode"]


# ---- checks at the edge ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        ({"tools": (FunctionTool("bad name"),)}, "tools[0].name"),
        ({"tools": (WEATHER, WEATHER)}, "tools[1].name"),
        ({"tools": (FunctionTool("f", "", "[1]"),)}, "tools[0].parameters"),
        ({"tools": (FunctionTool("f", "", "{oops"),)}, "tools[0].parameters"),
        ({"tools": (FunctionTool("f", "", '{"type": "string"}'),)}, "tools[0].parameters"),
        ({"tool_choice": ToolChoice("required")}, "tool_choice"),
        (
            {"tools": (WEATHER,), "tool_choice": ToolChoice("function", "nope")},
            "tool_choice.function_name",
        ),
        (
            {"tools": (WEATHER,), "tool_choice": ToolChoice("auto", "f")},
            "tool_choice.function_name",
        ),
        (
            {"messages": (ChatTurn("assistant", "", tool_calls=(ToolCallInput("", "f", "1"),)),)},
            "messages[0].tool_calls[0].arguments",
        ),
        (
            {"messages": (ChatTurn("user", "", tool_calls=(ToolCallInput("", "f", "{}"),)),)},
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tools_are_named(fields: dict[str, object], bad_field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate(valid_chat(**fields), Limits())
    assert bad_field in [v.field for v in caught.value.violations], caught.value


def test_tools_need_a_chat() -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate(RequestInput(prompt="x", tools=(WEATHER,)), Limits())
    assert caught.value.violations[0].field == "tools"


def test_only_forced_choices_get_a_constraint_and_none_parses_nothing() -> None:
    for mode, is_forced in [("auto", False), ("none", False), ("required", True)]:
        valid = validate(valid_chat(tools=(WEATHER,), tool_choice=ToolChoice(mode)), Limits())
        assert (valid.sampling.constraint is not None) == is_forced
        assert valid.is_parsing_tools == (mode != "none")
    thinking_off = validate(
        valid_chat(tools=(WEATHER,), tool_choice=ToolChoice("required"), enable_thinking=False),
        Limits(),
    )
    assert thinking_off.sampling.constraint is not None
    assert "<think>" not in thinking_off.sampling.constraint.text.split("\n")[0]
    assert json.loads(WEATHER.parameters)  # the fixture itself is JSON
