"""Render chat conversations into prompts: the checkpoint's Jinja template, or built-in ChatML.

The checkpoint's `chat_template` runs in Jinja's immutable sandbox with the same settings and
helpers HF transformers gives it (trim_blocks, lstrip_blocks, loop controls, `tojson`,
`raise_exception`, `strftime_now`), so a real Qwen3 checkpoint renders byte for byte as with
`tokenizer.apply_chat_template`. Checkpoints without one get `render_chatml`, Qwen3's layout:

    <|im_start|>system\nYou are ...<|im_end|>\n
    <|im_start|>user\nHi<|im_end|>\n
    <|im_start|>assistant\n<think>\n...\n</think>\n\nHello<|im_end|>\n   (after the last query)
    <|im_start|>assistant\n                                                (generation prompt)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mili.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    reasoning_content: str | None = None

    def as_dict(self) -> dict[str, str]:
        data = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            data["reasoning_content"] = self.reasoning_content
        return data


def check_roles(messages: list[Message], field: str = "messages") -> None:
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"{field}[{i}].role", message.role, f"must be one of {', '.join(ROLES)}"
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


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
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
        self, messages: list[Message], add_generation_prompt: bool, enable_thinking: bool | None
    ) -> str:
        check_roles(messages)
        if self._template is None:
            return render_chatml(messages, add_generation_prompt, enable_thinking)
        context: dict[str, Any] = {
            "messages": [m.as_dict() for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
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


def render_chatml(
    messages: list[Message], add_generation_prompt: bool, enable_thinking: bool | None
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
    for i, m in enumerate(messages):
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
