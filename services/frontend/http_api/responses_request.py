"""POST /v1/responses' body (OpenAI's Responses API) -> the chat request it asks for.

    input              a string (one user turn), or items in order:
                         {"role", "content"} or {"type": "message", ...}: content a string or
                           text parts (input_text, output_text)
                         {"type": "function_call", "call_id", "name", "arguments"}: a call the
                           assistant made (it joins the assistant turn before it)
                         {"type": "function_call_output", "call_id", "output"}: its result
                         {"type": "reasoning", "content": [reasoning_text]}: the next assistant
                           turn's reasoning_content
    instructions       a system turn before the input
    tools              [{"type": "function", "name", "description"?, "parameters"?,
                         "strict"?}]; tool_choice "auto" | "none" | "required" |
                       {"type": "function", "name"}; parallel_tool_calls
    text.format        {"type": "text" | "json_object"} or {"type": "json_schema", "name",
                       "schema", "strict"?}: the response_format
    max_output_tokens  max_tokens; temperature, top_p and vLLM's sampling extras as in chat
    reasoning.effort   "none": Qwen3 does not think (enable_thinking false); any other effort
                       thinks as the model does (it has no budget to set)
    reasoning.summary  "auto" | "concise" | "detailed": reasoning items carry the thinking as
                       their summary too (Qwen3 has no summarizer), for the clients that read
                       only a summary (the Vercel AI SDK, langchain)

The request is rewritten into a chat completions body and read by the one reader of those
(openai_request.chat_request): one set of rules, limits and validation. Its errors name the
Responses parameter the caller wrote (`input[2].arguments`, `text.format.schema`,
`max_output_tokens`). This server keeps no responses, as vLLM by default: `store` is
answered false, and what needs a stored one (previous_response_id, conversation,
item_reference, background) is refused, never ignored; so are hosted tools (web search, files)
and prompt templates. `include` of message.output_text.logprobs (or top_logprobs k > 0) gives
the answer's tokens their logprobs, with the k most likely at each (chat's logprobs and
top_logprobs).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mili.errors import FieldViolation, InvalidArgument
from services.frontend.http_api.body import Body
from services.frontend.http_api.openai_request import OpenAIRequest, chat_request

# Keys of the body passed on as they are: the sampling parameters the chat reader takes (vLLM
# takes these extras on /v1/responses too).
_PASSED = (
    "model",
    "stream",
    "temperature",
    "top_p",
    "user",
    "parallel_tool_calls",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "chat_template_kwargs",
    "priority",
)
_NO_STORE = "this server keeps no responses (store): send the whole conversation in input"
# The Vercel AI SDK sends an earlier turn's output as references to it unless told store: false
_NO_REFERENCE = (
    "this server keeps no responses (store): send the item itself, not a reference to it "
    "(a client that references earlier output sends it whole with store: false)"
)
# A known field we do not do -> whether its value is one we can answer anyway.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "previous_response_id": lambda v: False,
    "conversation": lambda v: False,
    "background": lambda v: v is False,
    "prompt": lambda v: False,  # a stored prompt template
    "truncation": lambda v: v == "disabled",
    "max_tool_calls": lambda v: False,
}
_REASONS = {
    "previous_response_id": _NO_STORE,
    "conversation": _NO_STORE,
    "background": _NO_STORE,
    "truncation": 'only "disabled": a conversation over the context window is refused',
}
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for them
# `include` entries we answer: reasoning items carry their text, unencrypted, so the first
# needs nothing.
_INCLUDABLE = ("reasoning.encrypted_content", LOGPROBS)
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
SUMMARIES = ("auto", "concise", "detailed")


@dataclass
class ResponsesParse:
    """The Parse of openai_call.open_call for /v1/responses; once called, `echo` holds what
    the response repeats of the request (OpenAI's Response fields)."""

    echo: dict[str, Any] = field(default_factory=dict)

    def __call__(self, body: Body, window: int | None, client_id: str) -> OpenAIRequest:
        chat, names = _chat_body(body)
        self.echo = _echo(body)
        try:
            request = chat_request(Body(chat), window, client_id)
        except InvalidArgument as exc:
            raise _renamed(exc, names) from None
        own = request.param_of
        return replace(request, param_of=lambda f: names.rename(own(f)))


class _Names:
    """Chat parameter names -> the Responses ones they came from."""

    def __init__(self) -> None:
        self.messages: list[str] = []  # messages[i] -> input[j] (or "instructions")
        self.calls: dict[tuple[int, int], str] = {}  # (message, call) -> input[j]

    def rename(self, name: str) -> str:
        if name == "messages":
            return "input"
        found = re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\](?:\.function)?)?", name)
        if found:
            i = int(found.group(1))
            where = self.messages[i] if i < len(self.messages) else "input"
            if found.group(2) is not None:
                where = self.calls.get((i, int(found.group(2))), where)
            return where + name[found.end() :]
        if name == "max_tokens":
            return "max_output_tokens"
        if name == "reasoning_effort":
            return "reasoning.effort"
        if name.startswith("response_format"):
            rest = name.removeprefix("response_format").replace(".json_schema", "", 1)
            return "text.format" + rest
        return re.sub(r"^tools\[(\d+)\]\.function", r"tools[\1]", name)


def _renamed(exc: InvalidArgument, names: _Names) -> InvalidArgument:
    violations = [FieldViolation(names.rename(v.field), v.description) for v in exc.violations]
    return InvalidArgument.many(violations)


def _chat_body(body: Body) -> tuple[dict[str, Any], _Names]:
    """The chat completions body this request asks for, and how to name its parameters."""
    for key, is_harmless in _UNSUPPORTED.items():
        value = body.raw(key)
        if value is not None and not is_harmless(value):
            reason = _REASONS.get(key, "not supported by this server")
            raise InvalidArgument(key, value, reason)
    body.flag("store")  # any: nothing is kept (answered false)
    for i, entry in enumerate(body.texts("include")):
        if entry not in _INCLUDABLE:
            raise InvalidArgument(f"include[{i}]", entry, "not supported by this server")
    chat = {key: body.raw(key) for key in _PASSED if body.has(key)}
    top = body.integer("top_logprobs")
    if LOGPROBS in body.texts("include") or top:
        chat["logprobs"], chat["top_logprobs"] = True, top
    names = _Names()
    messages: list[dict[str, Any]] = []
    instructions = body.text("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        names.messages.append("instructions")
    num_before = len(messages)
    _add_input(body, messages, names)
    if len(messages) == num_before:  # reasoning items alone
        raise InvalidArgument("input", body.raw("input"), "holds no message, call or call output")
    chat["messages"] = messages
    if body.has("max_output_tokens"):
        chat["max_tokens"] = body.raw("max_output_tokens")
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    if body.has("tool_choice"):
        chat["tool_choice"] = _tool_choice(body.raw("tool_choice"))
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    effort = _effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat, names


def _add_input(body: Body, messages: list[dict[str, Any]], names: _Names) -> None:
    raw = body.raw("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
        names.messages.append("input")
        return
    items = body.array("input")
    if not items:
        raise InvalidArgument("input", raw, "must be a string or a non-empty array of items")
    reasoning: str | None = None  # a reasoning item's text, for the next assistant turn
    for j, item in enumerate(items):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise InvalidArgument(where, item, "must be an object")
        it = Body(item, where)
        kind = it.text("type") or "message"
        if kind == "message":
            role = it.text("role")
            if role not in _ROLES:
                raise InvalidArgument(it.name("role"), role, f"must be one of {', '.join(_ROLES)}")
            message: dict[str, Any] = {"role": role, "content": _text_of(it, "content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
            names.messages.append(where)
        elif kind == "function_call":
            call = {
                "id": _required_text(it, "call_id"),
                "type": "function",
                "function": {
                    "name": _required_text(it, "name"),
                    "arguments": _required_text(it, "arguments"),
                },
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls without text before them
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
                names.messages.append(where)
            calls = last.setdefault("tool_calls", [])
            names.calls[(len(messages) - 1, len(calls))] = where
            calls.append(call)
        elif kind == "function_call_output":
            output = _text_of(it, "output")
            messages.append(
                {"role": "tool", "tool_call_id": _required_text(it, "call_id"), "content": output}
            )
            names.messages.append(where)
        elif kind == "reasoning":
            reasoning = _reasoning_text(it)
        elif kind == "item_reference":
            raise InvalidArgument(it.name("type"), kind, _NO_REFERENCE)
        else:
            raise InvalidArgument(
                it.name("type"),
                kind,
                "only message, function_call, function_call_output and reasoning items are "
                "supported",
            )


def _required_text(item: Body, key: str) -> str:
    value = item.text(key)
    if value is None:
        raise InvalidArgument(item.name(key), None, "required")
    return value


def _text_of(item: Body, key: str) -> str:
    """A content or output: a string, or text parts joined (as chat joins its parts)."""
    value = item.raw(key)
    if isinstance(value, str):
        return value
    parts = item.array(key)
    if parts is None:
        raise InvalidArgument(item.name(key), None, "required")
    texts = []
    for k, part in enumerate(parts):
        where = f"{item.name(key)}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else part
        if kind not in _TEXT_PARTS:
            raise InvalidArgument(
                where, kind, "only text parts ({type: input_text, text}) are supported"
            )
        texts.append(_required_text(Body(part, where), "text"))
    return "\n".join(texts)


def _reasoning_text(item: Body) -> str:
    """A reasoning item's text: its reasoning_text parts (ours), else its summary's."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.array(key) or []
        texts = [
            _required_text(Body(p, f"{item.name(key)}[{k}]"), "text")
            for k, p in enumerate(parts)
            if isinstance(p, dict) and p.get("type") == kind
        ]
        if texts:
            return "\n".join(texts)
    return ""


def _tools(body: Body) -> list[dict[str, Any]]:
    """Function tools in the chat shape, keys in the caller's order (the prompt shows them)."""
    out = []
    for i, tool in enumerate(body.array("tools") or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else tool
        if kind != "function":
            raise InvalidArgument(
                f"{where}.type",
                kind,
                'only function tools ({"type": "function", "name", ...}) are supported',
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidArgument(
        "tool_choice", choice, 'must be "auto", "none", "required" or {"type": "function", "name"}'
    )


def _response_format(body: Body) -> dict[str, Any] | None:
    text = body.object("text")
    fmt = None if text is None else text.object("format")
    if fmt is None:
        return None
    if fmt.raw("type") != "json_schema":
        return fmt.data
    schema = {k: v for k, v in fmt.data.items() if k in ("name", "schema", "strict", "description")}
    return {"type": "json_schema", "json_schema": schema}


def _effort(body: Body) -> str | None:
    """reasoning.effort, once reasoning (its summary too) is checked."""
    reasoning = body.object("reasoning")
    if reasoning is None:
        return None
    summary = reasoning.text("summary")
    if summary is not None and summary not in SUMMARIES:
        raise InvalidArgument(
            "reasoning.summary", summary, f"must be one of {', '.join(SUMMARIES)}"
        )
    return reasoning.text("effort")  # its values checked where chat reads reasoning_effort


def _echo(body: Body) -> dict[str, Any]:
    """What a Response repeats of its request, as OpenAI's does."""
    text = body.object("text")
    reasoning = body.object("reasoning")
    metadata = body.object("metadata")
    fmt = {"format": {"type": "text"}} if text is None or not text.has("format") else text.data
    return {
        "instructions": body.text("instructions"),
        "max_output_tokens": body.integer("max_output_tokens"),
        "metadata": {} if metadata is None else metadata.data,
        "parallel_tool_calls": body.flag("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}
        if reasoning is None
        else {"effort": reasoning.raw("effort"), "summary": reasoning.raw("summary")},
        "store": False,
        "temperature": body.number("temperature"),
        "text": fmt,
        "tool_choice": body.raw("tool_choice") or "auto",
        "tools": body.array("tools") or [],
        "top_p": body.number("top_p"),
        "top_logprobs": body.integer("top_logprobs"),
        "truncation": "disabled",
        "user": body.text("user"),
    }
