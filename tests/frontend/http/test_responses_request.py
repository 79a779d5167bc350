"""/v1/responses bodies -> the chat request they ask for, and errors naming the Responses
parameter the caller wrote (not the chat one it was rewritten to). No server: plain Python."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mili.errors import InvalidArgument
from services.frontend.http_api.body import parse
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.openai_request import OpenAIRequest
from services.frontend.http_api.responses_request import ResponsesParse
from services.frontend.tools import ToolCallInput, ToolChoice
from services.frontend.validation import ChatTurn, Limits, validate

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def responses(**fields: Any) -> OpenAIRequest:
    fields.setdefault("input", "hi")
    return ResponsesParse()(parse(json.dumps(fields).encode()), 4096, "rid")


def param_of_failure(**fields: Any) -> str:
    with pytest.raises(InvalidArgument) as caught:
        responses(**fields)
    response = response_of(caught.value)
    assert response.status == 400 and response.text is not None
    return json.loads(response.text)["error"]["param"]  # type: ignore[no-any-return]


def validation_param(request: OpenAIRequest) -> str:
    """The parameter validation's first complaint names, as the handler maps it."""
    with pytest.raises(InvalidArgument) as caught:
        validate(request.inputs[0], Limits(max_tokens_limit=1000))
    response = response_of(caught.value, request.param_of)
    assert response.status == 400 and response.text is not None
    return json.loads(response.text)["error"]["param"]  # type: ignore[no-any-return]


def test_a_string_input_is_one_user_turn_after_the_instructions() -> None:
    (chat,) = responses(input="hi", instructions="Be brief.").inputs
    assert chat.messages == (ChatTurn("system", "Be brief."), ChatTurn("user", "hi"))


def text(kind: str, value: str) -> dict[str, str]:
    return {"type": kind, "text": value}


def test_items_become_turns_calls_joining_the_assistant_turn_before_them() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    said = [text("output_text", "Let me look.")]
    (chat,) = responses(
        input=[
            {"role": "developer", "content": [text("input_text", "rules")]},
            {"role": "user", "content": [text("input_text", "a"), text("input_text", "b")]},
            {"type": "reasoning", "summary": [], "content": [text("reasoning_text", "hmm")]},
            {"type": "message", "role": "assistant", "content": said},
            call,
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [text("input_text", "rain")],
            },
            {"type": "reasoning", "summary": [text("summary_text", "short")]},
            call,
        ]
    ).inputs
    calls = (ToolCallInput("c1", "f", '{"a": 1}'), ToolCallInput("c2", "f", '{"a": 1}'))
    expected = (
        ChatTurn("system", "rules"),  # developer is the system turn, as in chat
        ChatTurn("user", "a\nb"),
        ChatTurn("assistant", "Let me look.", reasoning_content="hmm", tool_calls=calls),
        ChatTurn("tool", "sunny", tool_call_id="c1"),
        ChatTurn("tool", "rain", tool_call_id="c2"),
        ChatTurn("assistant", "", reasoning_content="short", tool_calls=calls[:1]),
    )
    assert chat.messages == expected


def test_tools_text_format_and_sampling_become_the_chat_ones() -> None:
    request = responses(
        tools=[{"type": "function", "name": "f", "parameters": WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        max_output_tokens=9,
        temperature=0.5,
        top_p=0.9,
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        seed=3,
    )
    (chat,) = request.inputs
    (tool,) = chat.tools
    assert (tool.name, json.loads(tool.parameters), tool.strict) == ("f", WEATHER, True)
    assert tool.keys == ("name", "parameters", "strict")  # the prompt lists them in this order
    assert chat.tool_choice == ToolChoice("function", "f") and not chat.parallel_tool_calls
    sampling = chat.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (9, 0.5, 0.9)
    assert sampling.seed == 3
    # Under a forced tool choice a response format is checked, not applied (as in chat)
    assert sampling.constraint is None
    shaped = responses(text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    constraint = shaped.inputs[0].sampling.constraint
    assert constraint is not None and json.loads(constraint.text) == WEATHER
    assert responses(text={"format": {"type": "text"}}).inputs[0].sampling.constraint is None


def test_logprobs_are_asked_by_include_or_top_logprobs() -> None:
    asked = responses(include=["message.output_text.logprobs"], top_logprobs=3)
    assert asked.is_chat_logprobs and asked.inputs[0].sampling.logprobs == 3
    alone = responses(include=["message.output_text.logprobs"])
    assert alone.is_chat_logprobs and alone.inputs[0].sampling.logprobs == 0
    assert responses(top_logprobs=2).inputs[0].sampling.logprobs == 2
    unasked = responses(top_logprobs=0)
    assert not unasked.is_chat_logprobs and unasked.inputs[0].sampling.logprobs is None
    assert validation_param(responses(top_logprobs=21)) == "top_logprobs"


def test_reasoning_effort_none_turns_thinking_off() -> None:
    assert responses(reasoning={"effort": "none"}).inputs[0].enable_thinking is False
    assert responses(reasoning={"effort": "high"}).inputs[0].enable_thinking is None
    assert responses().inputs[0].enable_thinking is None
    assert param_of_failure(reasoning={"effort": "max"}) == "reasoning.effort"
    thinking_on = {"enable_thinking": True}  # contradicted: a 400, not one of the two ignored
    assert (
        param_of_failure(reasoning={"effort": "none"}, chat_template_kwargs=thinking_on)
        == "reasoning.effort"
    )
    assert param_of_failure(reasoning={"summary": "brief"}) == "reasoning.summary"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tool_choice": 5}, "tool_choice"),
        ({"store": "no"}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include[0]"),
        ({"top_logprobs": "2"}, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "w"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"temperature": "hot"}, "temperature"),
        ({"instructions": 5}, "instructions"),
    ],
)
def test_bad_fields_are_named_as_the_caller_wrote_them(fields: dict[str, Any], param: str) -> None:
    assert param_of_failure(**fields) == param


def test_a_bad_tool_choice_is_told_in_the_responses_shape() -> None:
    with pytest.raises(InvalidArgument) as caught:
        responses(tool_choice=5)
    assert '{"type": "function", "name"}' in str(caught.value)  # not chat's nested function


def test_an_item_reference_is_refused_saying_how_to_send_it_whole() -> None:
    """The Vercel AI SDK sends an earlier turn's output as item_reference unless its request
    says store: false (providerOptions.openai.store); the message says so."""
    with pytest.raises(InvalidArgument) as caught:
        responses(input=[{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "m"}])
    (violation,) = caught.value.violations
    assert violation.field == "input[1].type"
    assert "store: false" in violation.description


def test_validation_errors_are_named_as_the_caller_wrote_them() -> None:
    assert validation_param(responses(max_output_tokens=0)) == "max_output_tokens"
    bad_tool = responses(tools=[{"type": "function", "name": "no spaces allowed"}])
    assert validation_param(bad_tool) == "tools[0].name"
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}
    said = {"role": "assistant", "content": "Let me look."}  # the call joins this turn
    bad_call = responses(input=[{"role": "user", "content": "x"}, said, call])
    assert validation_param(bad_call) == "input[2].arguments"


def test_what_needs_nothing_is_taken() -> None:
    request = responses(
        store=True,  # answered false: nothing is kept
        include=["reasoning.encrypted_content"],
        truncation="disabled",
        metadata={"k": "v"},
        background=False,
        top_logprobs=0,
    )
    assert request.inputs[0].messages == (ChatTurn("user", "hi"),)
