"""POST /v1/chat/completions: OpenAI's chat completions, plain or streamed.

    {"id": "chatcmpl-<request id>", "object": "chat.completion", "created", "model",
     "choices": [{"index", "message": {"role": "assistant", "content", "reasoning_content",
                                       "tool_calls"?},
                  "logprobs", "finish_reason"}], "usage", "prompt_logprobs"}

Streamed: a `chat.completion.chunk` per choice with `delta.role` first, then content, reasoning
and tool-call deltas, the last with finish_reason; a usage chunk (no choices) with
stream_options.include_usage (with continuous_usage_stats, every chunk has its choice's so
far). Qwen3's thinking (`<think>...</think>`) goes to `reasoning_content`, never to
`content`, however the text was cut; it is null when the model did not think (as vLLM has
it). With tools offered (tool_choice not none), each
`<tool_call>` block becomes one entry of `message.tool_calls` ({id, type: function,
function: {name, arguments: JSON text}}; streamed whole in one `delta.tool_calls` entry with its
index), and a generation that stopped after calls ends in finish_reason `tool_calls`; content
is then null when the model wrote nothing else (always under tool_choice required or named,
whose call cut by max_tokens is dropped: finish_reason `length`). The split is
services/frontend/chat_output.py, the one the gRPC API runs. vLLM's `prompt_logprobs` k fills
the response's `prompt_logprobs` with the templated prompt's (openai_logprobs.vllm_prompt_logprobs;
null when not asked, never streamed, as in vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from mili.errors import Unavailable
from services.frontend.chat_output import ChatOutput, OutputPiece
from services.frontend.generations import Generations
from services.frontend.http_api.choices import Choice, Usage, chunk_tail
from services.frontend.http_api.completions import detokenizer_of
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.openai_call import Head, open_call, respond
from services.frontend.http_api.openai_logprobs import (
    TokenPieces,
    chat_logprobs,
    prompt_logprobs_of,
)
from services.frontend.http_api.openai_request import OpenAIRequest, chat_request
from services.frontend.pipeline import Delta
from services.frontend.tool_calls import ToolCallDelta


async def create_chat_completion(
    request: web.Request, generations: Generations
) -> web.StreamResponse:
    call = await open_call(request, generations, chat_request)
    if isinstance(call, web.Response):
        return call
    pieces = None
    if call.request.is_chat_logprobs or call.request.prompt_logprobs is not None:
        try:
            pieces = TokenPieces(detokenizer_of(generations))
        except Unavailable as exc:
            return response_of(exc)
    chat = ChatJson(call.request, call.choices, call.head, pieces)
    return await respond(request, call, chat)


class ChatJson:
    """The response's JSON: whole, or as stream chunks (sse.Chunks)."""

    def __init__(
        self,
        request: OpenAIRequest,
        choices: Sequence[Choice],
        head: Head,
        pieces: TokenPieces | None,
    ) -> None:
        self._request = request
        self._choices = choices
        self._pieces = pieces
        self.prompt_logprobs_copies = 1  # the response's prompt_logprobs, once
        self._usage = Usage(choices)
        self._outputs = {c.index: ChatOutput.of(c.valid) for c in choices}
        # Streamed: each choice's deltas whose logprobs wait for the text they make
        self._unsent: dict[int, list[Delta]] = {c.index: [] for c in choices}
        self._head = head.json("chatcmpl", "chat.completion")
        # Each chunk is this head, its choices and the tail: one json.dumps per chunk.
        chunk_head = {**self._head, "object": "chat.completion.chunk"}
        self._chunk_head = json.dumps(chunk_head)[:-1] + ', "choices": ['
        self._content_heads = {
            c.index: f'{self._chunk_head}{{"index": {c.index}, "delta": {{"content": '
            for c in choices
        }
        self._reasoning_heads = {
            c.index: f'{self._chunk_head}{{"index": {c.index}, "delta": {{"reasoning_content": '
            for c in choices
        }

    def _split(self, index: int, deltas: list[Delta]) -> OutputPiece:
        """Reasoning, content and calls of these deltas of choice `index`; all that is left
        once it finished."""
        text = "".join(d.text for d in deltas)
        is_last = bool(deltas) and deltas[-1].finish_reason is not None
        starts = any(d.starts_in_reasoning for d in deltas)
        return self._outputs[index].push(text, is_last=is_last, starts_in_reasoning=starts)

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        if self._pieces is None or not self._request.is_chat_logprobs:
            return None
        ids = [t for d in deltas for t in d.token_ids]
        lps = [lp for d in deltas for lp in d.logprobs]
        return chat_logprobs(self._pieces, ids, lps)

    def _finish(self, index: int, deltas: list[Delta]) -> str | None:
        finish = deltas[-1].finish_reason if deltas else None
        if finish is None:
            return None
        self._usage.add(index, deltas[-1])
        return self._outputs[index].finish_reason(finish)

    def whole(self, deltas: dict[int, list[Delta]]) -> str:
        choices = []
        for c in self._choices:
            ds = deltas[c.index]
            reasoning, content, calls = self._split(c.index, ds)
            # An answer of calls (or of a forced tool choice, all calls) has null content.
            is_calls = bool(calls) or c.valid.tool_choice.is_forced
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content or None if is_calls else content,
                "reasoning_content": reasoning or None,
            }
            if calls:
                message["tool_calls"] = [_call_json(call) for call in calls]
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(ds),
                    "finish_reason": self._finish(c.index, ds),
                }
            )
        # One prompt for every choice (the first one computed its logprobs: choices.plan);
        # null when not asked, as vLLM writes it
        prompt_logprobs = None
        if self._request.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(deltas[self._choices[0].index])
        whole = {
            **self._head,
            "choices": choices,
            "usage": self._usage.as_json(),
            "prompt_logprobs": prompt_logprobs,
        }
        return json.dumps(whole)

    def _prompt_logprobs(self, deltas: list[Delta]) -> list[Any] | None:
        """vLLM's prompt_logprobs of the prompt of a choice (`deltas`: its own)."""
        assert self._pieces is not None and self._request.prompt_logprobs is not None
        return prompt_logprobs_of(self._pieces, deltas, self._request.prompt_logprobs)

    # ---- streamed ----

    def _chunk(self, choice: dict[str, Any], delta: Delta | None) -> str:
        return self._chunk_head + json.dumps(choice) + chunk_tail(self._request, delta)

    def opening(self, first: Delta | None = None) -> list[str]:
        # Sent with the first delta: its prompt tokens, none generated (vLLM's usage there)
        before = None if first is None else replace(first, num_completion_tokens=0)
        return [
            self._chunk(
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
                before,
            )
            for c in self._choices
        ]

    def of(self, index: int, delta: Delta) -> list[str]:
        # Once per streamed delta: the plain case (text on one side, no logprobs, not the
        # last) is written from a template around one json.dumps of the text.
        is_last = delta.finish_reason is not None
        reasoning, content, calls = self._outputs[index].push(
            delta.text, is_last, starts_in_reasoning=delta.starts_in_reasoning
        )
        if not is_last and not self._request.is_chat_logprobs and not calls:
            tail = '}, "logprobs": null, "finish_reason": null}' + chunk_tail(self._request, delta)
            if not reasoning:
                if not content:
                    return []  # only held-back text (a tag's beginning): nothing to say yet
                return [self._content_heads[index] + json.dumps(content) + tail]
            if not content:
                return [self._reasoning_heads[index] + json.dumps(reasoning) + tail]
        finish = self._finish(index, [delta])
        unsent = self._unsent[index]
        if self._request.is_chat_logprobs and delta.token_ids:
            unsent.append(delta)
        if not (reasoning or content or calls or finish):
            # A token whose text is held back (a character's first bytes, a tag's beginning)
            # sends its logprobs with the text it makes: a chunk with logprobs and no text is
            # one LiteLLM drops, logprobs and all.
            return []
        logprobs = self._logprobs(unsent) if unsent else None
        unsent.clear()
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = [{"index": c.index, **_call_json(c)} for c in calls]
        choice = {"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish}
        return [self._chunk(choice, delta)]

    def closing(self) -> list[str]:
        if not self._request.include_usage:
            return []
        chunk = {**self._head, "object": "chat.completion.chunk"}
        return [json.dumps({**chunk, "choices": [], "usage": self._usage.as_json()})]

    def failed(self, error: str) -> str:
        return error  # the error body as it is, as vLLM and OpenAI stream it


def _call_json(call: ToolCallDelta) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}
