"""POST /v1/responses through the openai SDK against the real services on the demo model: a
Response is the chat completion of the same conversation, as items (reasoning, message,
function_call), whole and streamed alike (the SDK's stream helper folds the events back into
the whole Response); conversation items reach the prompt as chat turns; what it cannot do is a
400 naming the parameter. The oracle is /v1/chat/completions on the same deployment (tested
against HF elsewhere): one split of the text, here in the Responses shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tokenizers import Tokenizer

from tests.e2e.conftest import Deployment

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ASK = "Weather in Paris?"
TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
FORMAT = {"type": "json_schema", "name": "weather", "schema": SCHEMA}  # text.format
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # chat's extra_body
ARGUMENTS = '{"city": "Paris", "days": 2}'
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGUMENTS}
FORCED = {"type": "function", "name": "get_weather"}  # tool_choice
CHAT_FORCED = {"type": "function", "function": {"name": "get_weather"}}
IMAGE = {"role": "user", "content": [{"type": "input_image"}]}
CHAT_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": ARGUMENTS},
}


@pytest.fixture(scope="module")
def client(pipeline: Deployment) -> openai.OpenAI:
    url = pipeline.frontend.http_url
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def think_bias(demo_model_dir: Path) -> dict[str, float]:
    """<think> all but forced where the constraint allows it, </think> favoured: the random
    model then thinks briefly before its constrained answer (it never thinks unprompted)."""
    hf = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    return {str(hf.token_to_id("<think>")): 100.0, str(hf.token_to_id("</think>")): 2.0}


def items(response: Any) -> list[tuple[str, str]]:
    """(type, text) of each output item: reasoning's text, message's text, a call's
    name(arguments)."""
    out = []
    for item in response.output:
        if item.type == "function_call":
            out.append((item.type, f"{item.name}({item.arguments})"))
        else:
            out.append((item.type, "".join(part.text for part in item.content)))
    return out


def summaries(response: Any) -> list[list[str]]:
    """Each reasoning item's summary texts."""
    return [[p.text for p in item.summary] for item in response.output if item.type == "reasoning"]


def facts(item: Any) -> tuple[str, str, str, str]:
    """What an item says: its id, type, status and text (a call's arguments)."""
    if item.type == "function_call":
        return item.id, item.type, item.status, item.arguments
    return item.id, item.type, item.status, "".join(part.text for part in item.content)


def streamed(client: openai.OpenAI, **args: Any) -> tuple[Any, list[Any]]:
    """The SDK stream helper's final Response, and the events it saw."""
    with client.responses.stream(**args) as stream:
        events = list(stream)
        return stream.get_final_response(), events


def check_events(events: list[Any], final: Any) -> None:
    """Numbered from 0 in order, opened by created/in_progress, closed by completed; the
    text deltas add up to each item's text."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == "response.completed" and events[-1].response.id == final.id
    # Each item added, then done as the final Response holds it (its status settled)
    for kind in ("added", "done"):
        told = [e for e in events if e.type == f"response.output_item.{kind}"]
        assert [e.output_index for e in told] == list(range(len(final.output)))
        if kind == "done":
            assert [facts(e.item) for e in told] == [facts(item) for item in final.output]
    assert all(item.status in ("completed", "incomplete") for item in final.output)
    # A part opens empty: its text comes in the deltas, which a client adds to it (the SDK's
    # snapshot of the text so far, carried by each output_text delta, ends as the text)
    parts = [e.part for e in events if e.type == "response.content_part.added"]
    assert [part.text for part in parts] == [""] * len(parts)
    for index, (kind, text) in enumerate(items(final)):
        snapshots = [
            e.snapshot
            for e in events
            if e.type == "response.output_text.delta" and e.output_index == index
        ]
        if snapshots:
            assert snapshots[-1] == text
        deltas = {
            summary: "".join(
                e.delta
                for e in events
                if e.type.endswith(".delta")
                and ("summary" in e.type) == summary
                and getattr(e, "output_index", None) == index
            )
            for summary in (False, True)
        }
        if kind == "function_call":
            assert f"{final.output[index].name}({deltas[False]})" == text
        else:
            assert deltas[False] == text
        if kind == "reasoning":  # a summary's deltas (reasoning.summary asked for one)
            assert deltas[True] == "".join(part.text for part in final.output[index].summary)


def test_a_response_is_the_chat_completion_as_items(client: openai.OpenAI, model: str) -> None:
    args: dict[str, Any] = dict(model=model, temperature=0, max_output_tokens=12)
    whole = client.responses.create(
        **args, input=ASK, instructions="Be brief.", extra_headers={"X-Request-Id": "resp-test-1"}
    )
    chat = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
    )
    (choice,) = chat.choices
    assert whole.id == "resp_resp-test-1" and whole.object == "response"
    assert whole.output_text == choice.message.content and items(whole)[0][0] == "message"
    assert chat.usage is not None and whole.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens == 12
    assert whole.usage.total_tokens == chat.usage.total_tokens
    # Cut by max_output_tokens: incomplete, saying why, its message too
    assert choice.finish_reason == "length"
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # type: ignore[union-attr]
    assert whole.output[0].status == "incomplete"
    # What the request set comes back, as OpenAI's Response has it
    assert (whole.instructions, whole.max_output_tokens, whole.temperature) == ("Be brief.", 12, 0)
    assert whole.store is False and whole.tools == [] and whole.tool_choice == "auto"

    final, events = streamed(client, **args, input=ASK, instructions="Be brief.")
    assert items(final) == items(whole) and final.status == "incomplete"
    assert final.usage is not None  # the same but for the prompt tokens now cached
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens_details == whole.usage.output_tokens_details
    assert final.usage.output_tokens == whole.usage.output_tokens
    check_events(events, final)


def test_thinking_is_a_reasoning_item_before_the_answer(
    client: openai.OpenAI, model: str, think_bias: dict[str, float]
) -> None:
    """A constrained answer with a short think block before it (logit_bias): the reasoning item
    holds chat's reasoning_content, the message its content; reasoning_tokens count the block."""

    class Weather(BaseModel):  # SCHEMA's bounds: the random model's strings end
        city: Annotated[str, Field(max_length=8)]
        days: Annotated[int, Field(ge=1, le=7)]

    num_thought = 0
    for seed in range(4):
        sampling: dict[str, Any] = dict(temperature=1.0, seed=seed, logit_bias=think_bias)
        # Asked for a summary (the Vercel AI SDK and langchain read nothing else):
        # the thinking is its own summary, the reasoning item's text in both places
        whole = client.responses.create(
            model=model, input=ASK, max_output_tokens=300, text={"format": FORMAT},
            reasoning={"summary": "auto"}, extra_body=sampling,
        )  # fmt: skip
        (choice,) = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ASK}], max_tokens=300,
            response_format=RESPONSE_FORMAT,
            extra_body=sampling,
        ).choices  # fmt: skip
        reasoning = getattr(choice.message, "reasoning_content", None)
        expected = [("reasoning", reasoning)] if reasoning else []
        assert items(whole) == [*expected, ("message", choice.message.content)]
        assert summaries(whole) == [[reasoning]] * len(expected)
        assert whole.status == "completed" and whole.incomplete_details is None
        jsonschema.validate(json.loads(whole.output_text), SCHEMA)
        assert whole.usage is not None
        details = whole.usage.output_tokens_details
        if reasoning:
            num_thought += 1
            assert 0 < details.reasoning_tokens < whole.usage.output_tokens
        else:
            assert details.reasoning_tokens == 0
        # The SDK's parse, its schema made from the pydantic model: the answer as the model
        parsed = client.responses.parse(
            model=model, input=ASK, max_output_tokens=300, text_format=Weather,
            extra_body=sampling,
        )  # fmt: skip
        assert isinstance(parsed.output_parsed, Weather) and parsed.status == "completed"
        assert all(summary == [] for summary in summaries(parsed))  # none asked for
        final, events = streamed(
            client, model=model, input=ASK, max_output_tokens=300,
            text={"format": FORMAT}, reasoning={"summary": "detailed"}, extra_body=sampling,
        )  # fmt: skip
        assert items(final) == items(whole) and summaries(final) == summaries(whole)
        check_events(events, final)
    assert num_thought > 0


def test_a_forced_call_is_a_function_call_item(client: openai.OpenAI, model: str) -> None:
    for seed in range(2):
        sampling: dict[str, Any] = dict(model=model, temperature=1.0)
        whole = client.responses.create(
            **sampling, input=ASK, tools=[TOOL], tool_choice=FORCED,
            reasoning={"effort": "none"}, max_output_tokens=200, extra_body={"seed": seed},
        )  # fmt: skip
        (choice,) = client.chat.completions.create(
            **sampling, messages=[{"role": "user", "content": ASK}], max_tokens=200, seed=seed,
            tools=[CHAT_TOOL], tool_choice=CHAT_FORCED,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        ).choices  # fmt: skip
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        (call,) = whole.output
        assert call.type == "function_call" and call.status == "completed"
        expected = choice.message.tool_calls[0].function
        assert (call.name, call.arguments) == (expected.name, expected.arguments)
        assert call.call_id.startswith("call_") and call.id and call.id != call.call_id
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
        assert whole.status == "completed"
        assert whole.tool_choice.name == "get_weather"  # type: ignore[union-attr]
        final, events = streamed(
            client, **sampling, input=ASK, tools=[TOOL], tool_choice="required",
            reasoning={"effort": "none"}, max_output_tokens=200, extra_body={"seed": seed},
        )  # fmt: skip
        assert [kind for kind, _ in items(final)] == ["function_call"]
        check_events(events, final)
        assert "response.function_call_arguments.done" in [e.type for e in events]


def test_conversation_items_reach_the_prompt_as_chat_turns(
    client: openai.OpenAI, model: str
) -> None:
    """A call made earlier and its result, sent back as items, make the prompt the same chat
    turns make (its token count), and the same greedy answer."""
    whole = client.responses.create(
        model=model, temperature=0, max_output_tokens=8, tools=[TOOL],
        input=[
            {"role": "user", "content": ASK},
            CALL,
            {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear"}'},
        ],
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=model, temperature=0, max_tokens=8,
        tools=[CHAT_TOOL],
        messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [CHAT_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
        ],
    )  # fmt: skip
    assert whole.usage is not None and chat.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.output_text == chat.choices[0].message.content


def test_what_needs_a_stored_response_or_a_hosted_tool_is_refused(
    client: openai.OpenAI, model: str
) -> None:
    for args, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [IMAGE]}, "input[0].content[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"stream": True, "max_output_tokens": 0}, "max_output_tokens"),  # before the stream
    ]:  # fmt: skip
        args.setdefault("input", ASK)
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=model, **args)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, error


def test_closing_a_stream_frees_its_blocks(
    pipeline: Deployment, client: openai.OpenAI, model: str
) -> None:
    before = pipeline.settled_free_blocks()
    stream = client.responses.create(
        model=model, input=ASK, max_output_tokens=2000, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    events = iter(stream)
    while next(events).type != "response.output_text.delta":
        pass  # decoding
    assert pipeline.free_blocks() != before  # decode holds the request's blocks
    stream.close()
    pipeline.wait_free_blocks(before)


def test_a_stored_response_asked_by_id_is_404_saying_none_is_kept(client: openai.OpenAI) -> None:
    calls = [
        lambda: client.responses.retrieve("resp_1"),
        lambda: client.responses.delete("resp_1"),
        lambda: client.responses.cancel("resp_1"),
        lambda: client.responses.input_items.list("resp_1"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError, match="keeps no responses"):
            call()


def same_logprobs(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> bool:
    """The same tokens, bytes and top ones, logprobs equal but for float32 rounding (a prompt
    prefilled whole or after a prefix-cache hit rounds differently)."""

    def shape(entries: list[dict[str, Any]]) -> list[Any]:
        return [
            (e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
            for e in entries
        ]

    def values(entries: list[dict[str, Any]]) -> list[float]:
        return [
            v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))
        ]

    return shape(got) == shape(expected) and values(got) == pytest.approx(
        values(expected), abs=1e-4
    )


def test_logprobs_are_the_answers_tokens_as_chat_gives_them(
    client: openai.OpenAI, model: str
) -> None:
    """include message.output_text.logprobs with top_logprobs: the message's tokens, each with
    its logprob, bytes and top ones, as chat completions gives them (thinking off: every token
    is the answer's); streamed, the deltas' logprobs add up to the whole's."""
    asked: dict[str, Any] = dict(
        model=model, input=ASK, temperature=0, max_output_tokens=6, top_logprobs=2,
        include=["message.output_text.logprobs"], reasoning={"effort": "none"},
    )  # fmt: skip
    whole = client.responses.create(**asked)
    (choice,) = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=6,
        logprobs=True, top_logprobs=2, extra_body=NO_THINKING,
    ).choices  # fmt: skip
    (message,) = whole.output
    (part,) = message.content  # type: ignore[union-attr]
    expected = [entry.model_dump() for entry in choice.logprobs.content]  # type: ignore[union-attr]
    got = [entry.model_dump() for entry in part.logprobs]
    assert len(got) == 6 and [len(e["top_logprobs"]) for e in got] == [2] * 6
    assert same_logprobs(got, expected)
    final, events = streamed(client, **asked)
    assert final.output_text == whole.output_text
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert same_logprobs([entry.model_dump() for d in deltas for entry in d.logprobs], got)
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert same_logprobs([entry.model_dump() for entry in done.logprobs], got)
    # Not asked: none
    plain = client.responses.create(**{**asked, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
