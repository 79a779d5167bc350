"""Qwen3's tool calls, parsed out of a stream of generated answer text.

Qwen3 calls a tool by writing a block per call, possibly after some text and possibly several:

    Let me check both.\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n
    </tool_call>\\n<tool_call>\\n{"name": ...}\\n</tool_call>

This parser runs on the *content* side of services/frontend/reasoning.py's ReasoningSplitter
(thinking is split off first, so a `<tool_call>` the model writes while thinking stays
reasoning). Text outside blocks is content; a block becomes one structured call. Like the
splitter, it is the same for any cut of the same text (tests/frontend/test_tool_calls.py tries
every cut into 2 and 3 pieces), and no tag or block JSON reaches content:

- a possible tag's beginning (`<tool_c`) is held back until the next delta says what it was;
- a call is emitted whole, once its block closes: index, id, name and the complete arguments in
  one ToolCallDelta. vLLM streams the name, then argument fragments; emitting whole costs a
  call's few tokens of latency (a client cannot act on half the arguments anyway) and buys
  the rule below, since nothing about a block is sent before it is known to be a call;
- a block whose JSON does not parse as {"name": "...", "arguments": {...}} is returned as
  content, tags and all, as vLLM does: the text is not lost, and nothing malformed is
  presented as a call. A block still open when the generation ends (max_tokens, or the model
  stopped before `</tool_call>`) is a call if its JSON parses, else content; with
  `drops_cut_call` (tool_choice required or named: the answer can only be calls) it is
  dropped instead, with its framing: the finish reason (`length`) says the answer was cut,
  and a half call is neither a call nor text the caller asked for;
- a `</tool_call>` inside one of the block's JSON strings (an argument holding code or markup)
  is text, not the block's end, unless a new `<tool_call>` follows it (blanks aside): then the
  string was never closed (malformed JSON, `"C:\\"}}`) and the block ended at that tag, so
  the calls after a malformed one are still calls;
- whitespace touching a parsed block is the block's framing (the chat template writes "\\n"
  between content and each call): dropped, so the content and calls render back to the same
  prompt. Whitespace elsewhere is kept (held back only until the next non-space text). Content
  after parsed blocks that follows content before them is parted from it by the first such
  block's framing ("Paris.\\n<call>\\nThen Tokyo." is "Paris.\\nThen Tokyo.", not glued);
  the template renders content before the calls only, so such a turn cannot render back
  exactly whatever is kept;
- a call's JSON must be JSON the next turn can send back (mili.text.strict_json: no NaN,
  no number past a float, no lone surrogate escape), else the block is content;
- a call's name is not checked against the offered tools (tool_choice auto; required and
  named allow only those): a call of another is still a call, as vLLM returns it. As content,
  the raw block would reach the end user as the answer, while a caller dispatching calls
  must refuse an unknown name anyway, and can say so in the tool result for the model's next
  turn.

Arguments are re-serialized from the parsed JSON (json.dumps, non-ASCII kept, key order kept),
the same text the chat template renders them as when the conversation comes back. Pure Python,
no protobuf: the HTTP and gRPC edges map a ParsedDelta to their own messages.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from mili.text.surrogate import lone_surrogate_path
from services.frontend.tools import parse_object

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:  # a dataclass, not a NamedTuple: `index` would shadow tuple.index
    index: int  # 0, 1, ... in the order the model made the calls
    id: str  # "call_" + 24 hex digits, made once per call
    name: str
    arguments: str  # the complete arguments, a JSON object in JSON text


class ParsedDelta(NamedTuple):
    content: str  # answer text to send now; may be ""
    tool_calls: list[ToolCallDelta]  # calls completed by this delta; usually []


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (and so may become it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _in_json_string(body: str) -> bool:
    """Whether `body` (a block's JSON so far) ends inside a string literal: a `</tool_call>`
    there is an argument's text (code, HTML), not the block's end. vLLM's parser cuts the call
    at it; here the call stays whole."""
    inside = escaped = False
    for char in body:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's body, or None if it is not a call: one whose JSON
    the next turn could not send back (NaN, a number past a float, a lone surrogate escape:
    mili.text.strict_json and the tokenizer's rules) is not one either."""
    value = parse_object(body)
    if value is None or lone_surrogate_path(value) is not None:
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class ToolCallParser:
    """One generation's content text in, (content, completed tool calls) out, delta by delta.

    Make one per generation, only when the request offers tools; after finish(), `num_calls`
    > 0 means the generation ended in tool calls (finish reason "tool_calls")."""

    def __init__(
        self, new_id: Callable[[], str] = new_call_id, *, drops_cut_call: bool = False
    ) -> None:
        self._new_id = new_id
        self._drops_cut_call = drops_cut_call
        self.num_calls = 0
        self._pending = ""  # unread text: a possible tag's beginning, outside a block
        self._space = ""  # trailing whitespace of the content, held until text follows it
        self._after_call = False  # whitespace here follows a parsed block: dropped
        self._block: str | None = None  # the open block's body so far; None outside one
        # Whether the open block's body holds a `<tool_call>`: only then can a quoted
        # `</tool_call>` end it (_block_end), whose search from the body's start is skipped
        # otherwise (repeated on every delta, it made a long call's parse quadratic)
        self._has_open_tag = False
        self._framing = ""  # whitespace before the open block's tag (content if it fails)
        self._is_said = False  # some content was sent
        # Content after parsed blocks, when content came before them, is parted from it by
        # the first such block's framing (sent only if more content comes).
        self._gap = ""

    def push(self, text: str) -> ParsedDelta:
        """The content and calls that `text` completes."""
        if self._block is None and not self._pending and not self._after_call and "<" not in text:
            # Fast path (most deltas): outside a block, no tag can start here. As _text: the
            # trailing whitespace is held (it may frame a block).
            body = text.rstrip()
            if not body:
                self._space += text
                return ParsedDelta("", [])
            said, self._space = self._space + body, text[len(body) :]
            self._is_said = True
            return ParsedDelta(said, [])
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        text, self._pending = self._pending + text, ""
        while text:
            if self._block is not None:
                start = max(0, len(self._block) - len(CLOSE) + 1)  # a tag cut by the last delta
                open_from = max(0, len(self._block) - len(OPEN) + 1)
                self._block += text
                self._has_open_tag = self._has_open_tag or self._block.find(OPEN, open_from) >= 0
                at = self._block_end(start)
                if at < 0:
                    break
                text = self._block[at + len(CLOSE) :]
                self._close(self._block[:at], content, calls, closed=True)
                continue
            at = text.find(OPEN)
            if at < 0:
                held = _partial_tag(text, OPEN)
                self._text(text[: len(text) - held], content)
                self._pending = text[len(text) - held :]
                break
            self._text(text[:at], content)
            self._block, self._framing, self._space = "", self._space, ""
            self._has_open_tag = False
            text = text[at + len(OPEN) :]
        return ParsedDelta("".join(content), calls)

    def _block_end(self, start: int) -> int:
        """Where the open block's closing tag is (searched from `start` on), or -1."""
        block = self._block
        assert block is not None
        at = block.find(CLOSE, start)
        while at >= 0 and _in_json_string(block[:at]):
            at = block.find(CLOSE, at + 1)  # text of an argument, not the tag
        # A quoted tag followed, blanks aside, by a new block's tag ended a block whose string
        # never closed; one followed by anything else is an argument's text (code that splits
        # on the tags, say).
        if not self._has_open_tag:
            return at  # no new block's tag to follow one
        quoted = block.find(CLOSE)
        while quoted >= 0 and (at < 0 or quoted < at):
            rest = block[quoted + len(CLOSE) :].lstrip()
            if rest.startswith(OPEN) and _in_json_string(block[:quoted]):
                return quoted
            quoted = block.find(CLOSE, quoted + 1)
        return at

    def finish(self) -> ParsedDelta:
        """Whatever was held back, at the end of the generation."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._block is not None:
            self._close(self._block, content, calls, closed=False)
        pending, self._pending = self._pending, ""
        self._text(pending, content)  # a tag cut short is text
        content.append(self._space)
        self._space = ""
        return ParsedDelta("".join(content), calls)

    def _text(self, text: str, content: list[str]) -> None:
        """Send content text, holding its trailing whitespace (it may frame a block)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
            self._space, self._gap = self._gap, ""
        body = text.rstrip()
        if body:
            content.append(self._space + body)
            self._space = ""
            self._is_said = True
        self._space += text[len(body) :]

    def _close(
        self, body: str, content: list[str], calls: list[ToolCallDelta], *, closed: bool
    ) -> None:
        """End the open block: a call if its body parses, else content as written (a block cut
        by the generation's end, under drops_cut_call: nothing)."""
        self._block = None
        parsed = parse_call(body)
        if parsed is None and not closed and self._drops_cut_call:
            self._framing = ""  # its framing goes with it
        elif parsed is None:
            framing = self._gap if self._after_call else self._framing
            content.append(framing + OPEN + body + (CLOSE if closed else ""))
            self._after_call, self._gap, self._is_said = False, "", True
        else:
            calls.append(ToolCallDelta(self.num_calls, self._new_id(), *parsed))
            self.num_calls += 1
            if self._is_said and not self._after_call:
                self._gap = self._framing
            self._after_call = True
        self._framing = ""
