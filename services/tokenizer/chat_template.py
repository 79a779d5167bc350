"""Render chat conversations into prompts: the checkpoint's Jinja template, or built-in ChatML.

The checkpoint's `chat_template` runs in Jinja's immutable sandbox with the same settings and
helpers HF transformers gives it (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, `strftime_now`), so a real Qwen3 checkpoint renders byte for byte as with
`tokenizer.apply_chat_template`. Checkpoints without one get `render_chatml`, Qwen3's layout:

    <|im_start|>system\nYou are ...<|im_end|>\n
    <|im_start|>user\nHi<|im_end|>\n
    <|im_start|>assistant\n<think>\n...\n</think>\n\nHello<|im_end|>\n   (after the last query)
    <|im_start|>assistant\n                                                (generation prompt)

With tools, Qwen3 lists them in its system turn (after the system message's text, if any) and
renders an assistant turn's calls after its content, one `<tool_call>` block each:

    <|im_start|>system\n[SYSTEM\n\n]# Tools\n...<tools>\n{tool json}\n</tools>\n...<|im_end|>\n
    <|im_start|>assistant\nText\n<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
        <|im_end|>\n                   (no line break before <|im_end|>)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mili.errors import InvalidArgument
from services.tokenizer.tools import Tool, ToolCall

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns: the calls the model made
    tool_call_id: str = ""  # tool turns: the call this result answers

    def as_dict(self) -> dict[str, Any]:
        """The message as HF's apply_chat_template hands it to a template."""
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            data["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            data["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id:
            data["tool_call_id"] = self.tool_call_id
        return data

    def texts(self) -> Iterator[str]:
        """Every piece of text the template may copy into the prompt."""
        yield self.content
        if self.reasoning_content is not None:
            yield self.reasoning_content
        for call in self.tool_calls:
            yield from call.texts()

    def map_text(self, fn: Callable[[str], str]) -> Message:
        """The message with `fn` applied to each of its texts (ids and role kept)."""
        return Message(
            self.role,
            fn(self.content),
            None if self.reasoning_content is None else fn(self.reasoning_content),
            tuple(call.map_text(fn) for call in self.tool_calls),
            self.tool_call_id,
        )


def check_roles(messages: list[Message]) -> None:
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{i}].role", message.role, f"must be one of {', '.join(ROLES)}"
            )


class _TemplateRaised(Exception):
    """raise_exception() called by a template: the conversation breaks the template's rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF overrides Jinja's tojson: no HTML escaping, non-ASCII kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: HF's mark of the assistant's part (for
    training masks, TRL-style templates): its body renders as written; nothing is tracked."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads it from the class)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; `source` is None for the built-in ChatML renderer."""

    def __init__(self, source: str | None, *, bos_token: str | None, eos_token: str | None) -> None:
        self.source = "checkpoint" if source is not None else "builtin"
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self._template: jinja2.Template | None = None
        if source is not None:
            try:
                self._template = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"invalid Jinja at line {e.lineno}: {e.message}") from None

    def render(
        self,
        messages: list[Message],
        add_generation_prompt: bool,
        enable_thinking: bool | None,
        tools: list[Tool] | None = None,
    ) -> str:
        check_roles(messages)
        if self._template is None:
            return render_chatml(messages, add_generation_prompt, enable_thinking, tools)
        context: dict[str, Any] = {
            "messages": [m.as_dict() for m in messages],
            "add_generation_prompt": add_generation_prompt,
            # HF passes None when the caller gives no tools; templates test `if tools`.
            "tools": [t.as_dict() for t in tools] if tools else None,
            "documents": None,
            **self._special,
        }
        if enable_thinking is not None:  # templates test `enable_thinking is defined`
            context["enable_thinking"] = enable_thinking
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise InvalidArgument(
                "messages", len(messages), f"rejected by the chat template: {e}"
            ) from None
        except jinja2.TemplateError as e:
            raise InvalidArgument("messages", len(messages), f"chat template failed: {e}") from e


def _is_tool_response(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


# Qwen3's system-turn text around the tool list (its template's words, which the model was
# trained on).
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _tool_calls(calls: tuple[ToolCall, ...], content: str) -> str:
    """An assistant turn's calls, each on its own line after the content (if any)."""
    blocks = [
        f'<tool_call>\n{{"name": "{c.name}", "arguments": {_tojson(c.arguments)}}}\n</tool_call>'
        for c in calls
    ]
    return ("\n" if content and blocks else "") + "\n".join(blocks)


def render_chatml(
    messages: list[Message],
    add_generation_prompt: bool,
    enable_thinking: bool | None,
    tools: list[Tool] | None = None,
) -> str:
    """Qwen3's ChatML layout, for checkpoints that ship no chat template."""
    # Reasoning is kept only on assistant turns after the last real user query (not a tool
    # result relayed as a user turn); earlier turns drop it, as Qwen3 was trained.
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user" and not _is_tool_response(messages[i].content):
            last_query = i
            break
    last = len(messages) - 1
    out: list[str] = []
    skip_first = False  # the first system message went into the tools' system turn
    if tools:
        system = ""
        if messages and messages[0].role == "system":
            system, skip_first = messages[0].content + "\n\n", True
        listed = "".join(f"\n{_tojson(t.as_dict())}" for t in tools)
        out.append(f"<|im_start|>system\n{system}{TOOLS_HEADER}{listed}{TOOLS_FOOTER}<|im_end|>\n")
    for i, m in enumerate(messages):
        if i == 0 and skip_first:
            continue
        if m.role in ("system", "user"):
            out.append(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n")
        elif m.role == "assistant":
            content, reasoning = m.content, m.reasoning_content
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    head, _, _ = content.partition("</think>")
                    reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == last or reasoning):
                out.append(
                    f"<|im_start|>assistant\n<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
                    f"{content.lstrip(chr(10))}"
                )
            else:
                out.append(f"<|im_start|>assistant\n{content}")
            out.append(_tool_calls(m.tool_calls, content))
            out.append("<|im_end|>\n")
        else:  # tool: consecutive tool results share one user turn
            if i == 0 or messages[i - 1].role != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{m.content}\n</tool_response>")
            if i == last or messages[i + 1].role != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        if enable_thinking is False:
            out.append("<think>\n\n</think>\n\n")
    return "".join(out)
