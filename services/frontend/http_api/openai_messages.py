"""A chat completion request's `messages` -> the frontend's ChatTurns: each role and its content
(a string, or text parts joined), an assistant turn's tool calls and a tool turn's call id
(openai_tools.py)."""

from __future__ import annotations

from mili.errors import InvalidArgument
from services.frontend.http_api import openai_tools
from services.frontend.http_api.body import Body
from services.frontend.validation import ChatTurn

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn


def messages_of(body: Body) -> tuple[ChatTurn, ...]:
    """The chat turns of `messages` (OpenAI's developer role is the system turn)."""
    messages = body.array("messages")
    if not messages:
        raise InvalidArgument("messages", messages, "must be a non-empty array")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{i}]", message, "must be an object")
        m = Body(message, f"messages[{i}]")
        role = m.text("role")
        if role is None:
            raise InvalidArgument(m.name("role"), None, "required")
        if role != "assistant" and m.raw("content") is None:  # as OpenAI: only an assistant
            # turn may leave it out (its tool calls are the turn)
            raise InvalidArgument(m.name("content"), None, f"required in a {role} message")
        turns.append(
            ChatTurn(
                role=_ROLES.get(role, role),
                content=_content(m),
                reasoning_content=m.text("reasoning_content"),
                **openai_tools.message_fields(m),
            )
        )
    return tuple(turns)


def _content(message: Body) -> str:
    """A message's content: a string, or text parts joined by newlines (as vLLM joins them)."""
    content = message.raw("content")
    if content is None or isinstance(content, str):
        return content or ""
    parts = message.array("content")
    assert parts is not None
    texts = []
    for j, part in enumerate(parts):
        where = f"{message.name('content')}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else part
            raise InvalidArgument(where, kind, "only text parts ({type: text, text}) are supported")
        text = Body(part, where).text("text")
        texts.append(text or "")
    return "\n".join(texts)
