"""POST /v1/responses: OpenAI's Responses API, stateless, whole or streamed.

    {"id": "resp_<request id>", "object": "response", "created_at", "status": "completed" |
     "incomplete", "incomplete_details": {"reason": "max_output_tokens"} | null, "model",
     "output": [items in the order generated], "usage": {"input_tokens",
     "input_tokens_details": {"cached_tokens"}, "output_tokens",
     "output_tokens_details": {"reasoning_tokens"}, "total_tokens"}, and what the request set
     (instructions, tools, tool_choice, text, ...: responses_request._echo)}

    items   {"type": "reasoning", "content": [{"type": "reasoning_text", "text"}],
             "summary": []}                                     Qwen3's thinking
             (with reasoning.summary, "summary": [{"type": "summary_text", "text"}] too)
            {"type": "message", "role": "assistant", "status",
             "content": [{"type": "output_text", "text", "annotations": []}]}    the answer
            {"type": "function_call", "call_id", "name", "arguments", "status"}  each call

The split of the generated text is the chat API's (services/frontend/chat_output.py): the same
reasoning, content and calls, here as items. Streamed (stream: true), the events OpenAI's SDK
folds back into a Response: response.created and response.in_progress; per item
response.output_item.added, its content part's added, its text's deltas and done
(response.reasoning_text.* / response.output_text.*, response.function_call_arguments.* for a
call, which comes whole; a summarized reasoning item's response.reasoning_summary_part.* and
_text.* as well), the part's and the item's done; then response.completed holding the
whole Response (its status "incomplete" when max_output_tokens cut it); or, failing after
the headers, {"type": "error", "error": {the error body's}} as OpenAI ends a stream that
fails. Every event has its `type` and a `sequence_number` from 0. reasoning_tokens counts the
tokens before the answer's first text when the model thought (the think block's tags and the
blank line after it included).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from aiohttp import web

from mili.errors import Unavailable
from services.frontend.chat_output import ChatOutput
from services.frontend.generations import Generations
from services.frontend.http_api.choices import Choice, Usage
from services.frontend.http_api.completions import detokenizer_of
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.openai_call import Head, open_call, respond
from services.frontend.http_api.openai_logprobs import TokenPieces, chat_logprobs
from services.frontend.http_api.responses_request import SUMMARIES, ResponsesParse
from services.frontend.pipeline import Delta
from services.frontend.tool_calls import ToolCallDelta


async def create_response(request: web.Request, generations: Generations) -> web.StreamResponse:
    parse = ResponsesParse()
    call = await open_call(request, generations, parse)
    if isinstance(call, web.Response):
        return call
    pieces = None
    if call.request.is_chat_logprobs:
        try:
            pieces = TokenPieces(detokenizer_of(generations))
        except Unavailable as exc:
            return response_of(exc)
    shape = ResponsesJson(call.choices[0], call.head, parse.echo, pieces)
    return await respond(request, call, shape)


class ResponsesJson:
    """The Response: whole, or as stream events (sse.Chunks). One choice (no `n` here)."""

    prompt_logprobs_copies = 0  # no prompt logprobs in this API

    def __init__(
        self,
        choice: Choice,
        head: Head,
        echo: dict[str, Any],
        pieces: TokenPieces | None = None,
    ) -> None:
        self._choice = choice
        self._pieces = pieces  # logprobs asked for: the answer's tokens get theirs
        # The logprobs of the open message, and of tokens whose text is not out yet (held back
        # until the next delta settles it): the answer's if it comes next
        self._open_logprobs: list[dict[str, Any]] = []
        self._pending_logprobs: list[dict[str, Any]] = []
        self._output = ChatOutput.of(choice.valid)
        self._usage = Usage([choice])
        self._id = head.request_id
        self._head = {
            "id": f"resp_{head.request_id}",
            "object": "response",
            "created_at": head.created,
            "model": head.model,
        }
        self._echo = echo
        # A summary asked for is the thinking itself, in both places: OpenAI's models give a
        # summary, vLLM the text (content), and clients read one or the other
        self._is_summarized = echo["reasoning"]["summary"] in SUMMARIES
        self._items: list[dict[str, Any]] = []  # the output so far
        self._open: dict[str, Any] | None = None  # the text item being written (last one)
        self._open_text: list[str] = []  # its text so far
        self._sequence_number = 0
        self._finish: str | None = None
        self._has_reasoning = False
        self._is_answering = False  # text or a call of the answer came out
        self._num_before_answer = 0  # tokens before it

    # ---- the output, delta by delta ----

    def _push(self, delta: Delta) -> list[dict[str, Any]]:
        """Feed one delta; the events it makes."""
        is_last = delta.finish_reason is not None
        reasoning, content, calls = self._output.push(
            delta.text, is_last, starts_in_reasoning=delta.starts_in_reasoning
        )
        self._has_reasoning |= bool(reasoning)
        if not self._is_answering:
            self._is_answering = bool(content or calls)
            if not self._is_answering:
                self._num_before_answer += len(delta.token_ids)
        logprobs = self._logprobs(delta)
        if not (content or reasoning or calls):
            self._pending_logprobs += logprobs
        elif content:
            logprobs, self._pending_logprobs = self._pending_logprobs + logprobs, []
        else:  # thinking or calls: no logprobs of theirs in the answer
            self._pending_logprobs = []
        events = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if content:
            events += self._text("message", content, logprobs)
        for call in calls:
            events += self._call(call)
        if is_last:
            self._usage.add(self._choice.index, delta)
            assert delta.finish_reason is not None
            self._finish = self._output.finish_reason(delta.finish_reason)
            events += self._close()
        return events

    def _logprobs(self, delta: Delta) -> list[dict[str, Any]]:
        """The delta's tokens' logprobs in the Responses shape (chat's entries), if asked."""
        if self._pieces is None or not delta.token_ids:
            return []
        entries: list[dict[str, Any]] = chat_logprobs(
            self._pieces, delta.token_ids, delta.logprobs
        )["content"]
        return entries

    def _text(
        self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """`text` added to the open item of `kind`, opened first (closing another) if need be;
        a message's with its tokens' `logprobs`."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        self._open_text.append(text)  # joined at the item's close: += would copy it all each time
        where = self._where(item)
        if kind == "reasoning":
            events.append({"type": "response.reasoning_text.delta", **where, "delta": text})
            if self._is_summarized:  # its text, too, joined at the close
                at = self._summary_where(item)
                events.append(
                    {"type": "response.reasoning_summary_text.delta", **at, "delta": text}
                )
        else:
            self._open_logprobs += logprobs or []
            events.append(
                {
                    "type": "response.output_text.delta",
                    **where,
                    "delta": text,
                    "logprobs": logprobs or [],
                }
            )
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        n = len(self._items)
        item: dict[str, Any]
        if kind == "reasoning":
            item = {
                "id": f"rs_{self._id}_{n}",
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": f"msg_{self._id}_{n}",
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._items.append(item)
        self._open = item
        events = [self._item_event("response.output_item.added", item)]
        item["content"].append(part)
        # A copy, empty: the part's text grows before this event is written, and a client adds
        # every delta to the part it was given (the SDK's stream snapshot doubled the first)
        events.append(
            {"type": "response.content_part.added", **self._where(item), "part": {**part}}
        )
        if kind == "reasoning" and self._is_summarized:
            summary = {"type": "summary_text", "text": ""}
            item["summary"].append(summary)
            at = self._summary_where(item)
            events.append(
                {"type": "response.reasoning_summary_part.added", **at, "part": {**summary}}
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The open text item's done events, if one is open."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = self._status()
        part = item["content"][0]
        part["text"], self._open_text = "".join(self._open_text), []
        where = self._where(item)
        events = []
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
            if self._is_summarized:
                summary, at = item["summary"][0], self._summary_where(item)
                summary["text"] = part["text"]
                events += [
                    {"type": "response.reasoning_summary_text.done", **at, "text": summary["text"]},
                    {"type": "response.reasoning_summary_part.done", **at, "part": summary},
                ]
        else:
            part["logprobs"], self._open_logprobs = self._open_logprobs, []
            done = {"type": "response.output_text.done", **where, "text": part["text"]}
            done["logprobs"] = part["logprobs"]
        return [
            *events,
            done,
            {"type": "response.content_part.done", **where, "part": part},
            self._item_event("response.output_item.done", item),
        ]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        """A call, whole: its item added, its arguments in one delta, done."""
        events = self._close()
        item = {
            "id": f"fc_{self._id}_{len(self._items)}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self._items.append(item)
        events.append(self._item_event("response.output_item.added", item))
        where = {"item_id": item["id"], "output_index": len(self._items) - 1}
        events.append(
            {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments}
        )
        item["arguments"] = call.arguments
        item["status"] = "completed"
        events.append(
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        events.append(self._item_event("response.output_item.done", item))
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._items.index(item), "content_index": 0}

    def _summary_where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._items.index(item), "summary_index": 0}

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        # A copy: the item goes on changing after an "added" event is written.
        return {
            "type": kind,
            "output_index": self._items.index(item),
            "item": copy.deepcopy(item),
        }

    def _status(self) -> str:
        return "incomplete" if self._finish == "length" else "completed"

    # ---- the Response ----

    def _response(self, *, is_done: bool) -> dict[str, Any]:
        if not is_done:
            status, details, output, usage = "in_progress", None, [], None
        else:
            status = self._status()
            details = {"reason": "max_output_tokens"} if status == "incomplete" else None
            output, usage = self._items, self._usage_json()
        return {
            **self._head,
            "status": status,
            "error": None,
            "incomplete_details": details,
            "output": output,
            "usage": usage,
            **self._echo,
        }

    def _usage_json(self) -> dict[str, Any]:
        chat = self._usage.as_json()
        reasoning = self._num_before_answer if self._has_reasoning else 0
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": chat["total_tokens"],
        }

    def whole(self, deltas: dict[int, list[Delta]]) -> str:
        for delta in deltas[self._choice.index]:
            self._push(delta)
        return json.dumps(self._response(is_done=True))

    # ---- streamed ----

    def _numbered(self, events: list[dict[str, Any]]) -> list[str]:
        out = []
        for event in events:
            out.append(json.dumps({**event, "sequence_number": self._sequence_number}))
            self._sequence_number += 1
        return out

    def opening(self, first: Delta | None = None) -> list[str]:
        response = self._response(is_done=False)
        return self._numbered(
            [
                {"type": "response.created", "response": response},
                {"type": "response.in_progress", "response": response},
            ]
        )

    def of(self, index: int, delta: Delta) -> list[str]:
        return self._numbered(self._push(delta))

    def failed(self, error: str) -> str:
        # OpenAI's error event: the HTTP error body's object, typed and numbered as events are
        # (a bare {"error"} fails the Vercel AI SDK's check of the event before its message shows)
        (text,) = self._numbered([{"type": "error", **json.loads(error)}])
        return text

    def closing(self) -> list[str]:
        # response.completed even when incomplete (its status says so), as vLLM ends every
        # stream: the SDK's stream helper (responses.stream) takes its final response from it
        return self._numbered(
            [{"type": "response.completed", "response": self._response(is_done=True)}]
        )
