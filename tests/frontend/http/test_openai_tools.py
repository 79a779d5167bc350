"""OpenAI tools, tool_choice, tool messages and structured-output parameters -> the frontend's
types and one Constraint; the chat response's tool_calls, plain and streamed over every cut;
errors naming the parameter as the caller wrote it. No server: plain Python."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from mili.engine.constraint.spec import Constraint
from mili.engine.stop import FinishReason
from mili.errors import InvalidArgument
from services.frontend.http_api.body import parse
from services.frontend.http_api.chat import ChatJson
from services.frontend.http_api.choices import Choice
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.openai_call import Head
from services.frontend.http_api.openai_request import OpenAIRequest, chat_request
from services.frontend.pipeline import Delta
from services.frontend.tools import FunctionTool, ToolCallInput, ToolChoice
from services.frontend.validation import Limits, validate

LIMITS = Limits(max_tokens_limit=1000)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
CALLING = (
    "<think>\nhm\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def chat(**fields: Any) -> OpenAIRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return chat_request(parse(json.dumps(fields).encode()), 4096, "rid")


def param_of_failure(**fields: Any) -> str | None:
    """The 400's param: from parsing, else from validation (mapped as the handlers map it)."""
    try:
        request = chat(**fields)
        with pytest.raises(InvalidArgument) as caught:
            validate(request.inputs[0], LIMITS)
        response = response_of(caught.value, request.param_of)
    except InvalidArgument as exc:
        response = response_of(exc)
    assert response.status == 400 and response.text is not None
    return json.loads(response.text)["error"]["param"]  # type: ignore[no-any-return]


def test_tools_choice_and_tool_turns_are_read() -> None:
    request = chat(
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[{**TOOL, "function": {**TOOL["function"], "description": "d", "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    (given,) = request.inputs
    keys = ("name", "parameters", "description", "strict")  # as sent: the prompt's order
    assert given.tools == (FunctionTool("get_weather", "d", json.dumps(WEATHER), True, keys),)
    assert given.tool_choice == ToolChoice("function", "get_weather")
    assert not given.parallel_tool_calls
    call = ToolCallInput("call_1", "get_weather", '{"city": "Paris"}')
    assert given.messages[1].tool_calls == (call,) and given.messages[1].content == ""
    assert given.messages[2].tool_call_id == "call_1"
    assert validate(given, LIMITS).sampling.constraint is not None
    assert chat(tools=[TOOL], tool_choice="required").inputs[0].tool_choice.mode == "required"
    assert chat(tools=[TOOL]).inputs[0].tool_choice.mode == "auto"
    # Without their type, a tool and a named choice are functions, as vLLM defaults them
    untyped = chat(
        tools=[{"function": TOOL["function"]}], tool_choice={"function": {"name": "get_weather"}}
    )
    assert untyped.inputs[0].tools == chat(tools=[TOOL]).inputs[0].tools
    assert untyped.inputs[0].tool_choice == ToolChoice("function", "get_weather")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {**TOOL["function"], "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": ["get_weather"]}, "tools[0].type"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "guided_json": {"type": "object"},  # a response_format there is not applied
            },
            "tool_choice",
        ),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice[1]"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_regex": "x" * 5000}, "guided_regex"),
        ({"guided_json": "[1, 2]"}, "guided_json"),
    ],
)
def test_errors_name_the_parameter(fields: dict[str, Any], param: str) -> None:
    assert param_of_failure(**fields) == param


@pytest.mark.parametrize(
    ("fields", "constraint", "param"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, Constraint.json_object(), "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
                }
            },
            Constraint.json_schema(WEATHER),
            "response_format",
        ),
        ({"guided_json": WEATHER}, Constraint.json_schema(WEATHER), "guided_json"),
        ({"guided_json": json.dumps(WEATHER)}, Constraint.json_schema(WEATHER), "guided_json"),
        ({"guided_regex": "[a-z]+"}, Constraint.regex("[a-z]+"), "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, Constraint.choice(["yes", "no"]), "guided_choice"),
        ({"guided_grammar": 'start: "a"'}, Constraint.grammar('start: "a"'), "guided_grammar"),
        (
            {"structured_outputs": {"choice": ["a"]}},
            Constraint.choice(["a"]),
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            Constraint.json_object(),
            "structured_outputs.json_object",
        ),
        (
            {"tools": [TOOL], "tool_choice": "auto", "guided_regex": "a"},
            Constraint.regex("a"),
            "guided_regex",
        ),
    ],
)
def test_structured_output_parameters_map_to_one_constraint(
    fields: dict[str, Any], constraint: Constraint | None, param: str | None
) -> None:
    request = chat(**fields)
    assert request.inputs[0].sampling.constraint == constraint
    # A compile error's field (sampling.<kind>) names the parameter that asked for it.
    assert request.param_of("sampling.json_schema") == (param or "tools")


def _choice(**fields: Any) -> list[Choice]:
    valid = validate(chat(**fields).inputs[0], LIMITS)
    return [Choice(0, 0, valid)]


def _deltas(text: str, cuts: list[int]) -> list[Delta]:
    bounds = [0, *cuts, len(text)]
    out = [Delta([i], text[a:b]) for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    out[-1].finish_reason = FinishReason.STOP
    return out


def test_chat_response_tool_calls_plain_and_streamed_over_every_cut() -> None:
    head = Head("r", 1, "m")
    plain = ChatJson(chat(tools=[TOOL]), _choice(tools=[TOOL]), head, None)
    (choice,) = json.loads(plain.whole({0: _deltas(CALLING, [])}))["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "hm"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    for a in range(0, len(CALLING) + 1, 3):
        for b in range(a, len(CALLING) + 1, 11):
            streamed = ChatJson(chat(tools=[TOOL], stream=True), _choice(tools=[TOOL]), head, None)
            chunks = [json.loads(line) for line in streamed.opening()]
            for delta in _deltas(CALLING, [a, b]):
                chunks += [json.loads(line) for line in streamed.of(0, delta)]
            said = [c["choices"][0]["delta"] for c in chunks[1:]]
            assert "".join(d.get("content", "") for d in said) == ""
            assert "".join(d.get("reasoning_content", "") for d in said) == "hm"
            (entry,) = [t for d in said for t in d.get("tool_calls", [])]
            assert entry["index"] == 0 and entry["function"] == call["function"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_a_block_is_content_and_the_finish_is_stop() -> None:
    plain = ChatJson(chat(), _choice(), Head("r", 1, "m"), None)
    (choice,) = json.loads(plain.whole({0: _deltas(CALLING, [])}))["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>")
