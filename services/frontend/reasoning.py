"""Qwen3's thinking, split from the answer in a stream of generated text.

Qwen3 thinks before it answers: `<think>\\nreasoning\\n</think>\\n\\nanswer`. The OpenAI-style chat
API returns the two apart (`reasoning_content`, `content`), and a client reading `content` must
never see a tag or a word of the reasoning, however the text was cut into deltas. So text is
emitted only once it cannot be part of a tag: a delta ending in `</thi` holds those characters
back until the next one says what they were.

    <think>   switches to reasoning (anywhere: a tag never reaches content)
    </think>  switches to content (one without an opening tag is dropped as well)

Qwen3's hybrid template leaves the block to the model (it writes <think> itself); the
Thinking-2507 models' templates open it in the generation prompt, and the model writes only the
reasoning and `</think>`: there the text starts as reasoning (`opens_reasoning` of the prompt,
`is_reasoning` set before the first push).

Newlines the model puts around its reasoning are trimmed as the chat template trims them when it
renders an earlier turn (services/tokenizer/chat_template.py): those after either tag, and those
before `</think>` (held back in reasoning until something other than a newline or the closing
tag follows). The result is the same for any cut of the same text (tests/frontend/
test_reasoning.py tries every one). Pure Python, per delta: no regex, no copy of the whole text.

Under a constraint (a caller's, or a forced tool choice's) with thinking on, the grammar lets
the model think first (mili.engine.constraint.think: `think_block` says which shape), and the
output is at most one think block at its very start, then the answer: `ThinkFirstSplitter`
splits off that block only, and passes the answer through as it was generated (a "<think>"
inside a JSON string is the string's text).
"""

from __future__ import annotations

from typing import Literal

from mili.engine.constraint.spec import ThinkBlock
from mili.engine.constraint.think import SEPARATOR

OPEN = "<think>"
CLOSE = "</think>"
_TAGS = (OPEN, CLOSE)


# Where the chat template's generation prompt begins (ChatML): what follows it is the
# template's, not a caller's text (a user may write "<think>" in a message).
_GENERATION_PROMPT = "<|im_start|>assistant"


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered chat prompt ends inside a think block its generation prompt opened
    (Qwen3's Thinking-2507 templates end with "<think>\\n"): the output begins as reasoning."""
    tail = prompt[prompt.rfind(_GENERATION_PROMPT) :] if _GENERATION_PROMPT in prompt else ""
    return tail.rfind(OPEN) > tail.rfind(CLOSE)


def _held_tail(text: str) -> int:
    """Length of the longest end of `text` that begins a tag (and so may become one)."""
    for n in range(min(len(text), len(CLOSE) - 1), 0, -1):
        tail = text[-n:]
        if OPEN.startswith(tail) or CLOSE.startswith(tail):
            return n
    return 0


class ReasoningSplitter:
    """One generation's text in, (reasoning, content) out, delta by delta."""

    def __init__(self) -> None:
        self.is_reasoning = False
        self._held = ""  # a possible tag's beginning, or reasoning's trailing newlines
        self._after_tag = False  # newlines here follow a tag: trimmed

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text` completes; either may be ""."""
        if not self._held and not self._after_tag and "<" not in text:
            # Fast path (most deltas): no tag can start here, nothing is pending. The general
            # path below gives the same: content as is, or reasoning with its trailing
            # newlines held back.
            if not self.is_reasoning:
                return "", text
            kept = text.rstrip("\n")
            self._held = text[len(kept) :]
            return kept, ""
        text = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            at, tag = min(((text.find(t), t) for t in _TAGS if t in text), default=(-1, ""))
            if at < 0:
                held = _held_tail(text)
                part, self._held = text[: len(text) - held], text[len(text) - held :]
                self._emit(part, reasoning, content, is_final=False)
                break
            self._emit(text[:at], reasoning, content, is_final=True)
            self.is_reasoning = tag == OPEN
            self._after_tag = True
            text = text[at + len(tag) :]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the generation (a tag cut short is text)."""
        held, self._held = self._held, ""
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(held, reasoning, content, is_final=False, is_end=True)
        return "".join(reasoning), "".join(content)

    def _emit(
        self,
        part: str,
        reasoning: list[str],
        content: list[str],
        *,
        is_final: bool,
        is_end: bool = False,
    ) -> None:
        """Send `part` to the current side. `is_final`: a tag follows it (reasoning's trailing
        newlines are dropped); otherwise they are held until more text shows what they end."""
        if self._after_tag:
            part = part.lstrip("\n")
            if part:
                self._after_tag = False
        if not self.is_reasoning:
            content.append(part)
            return
        if is_final:
            reasoning.append(part.rstrip("\n"))
            return
        kept = part if is_end else part.rstrip("\n")
        reasoning.append(kept)
        self._held = part[len(kept) :] + self._held


def think_block(
    is_chat: bool, enable_thinking: bool | None, starts_in_reasoning: bool
) -> ThinkBlock:
    """What comes before a request's constraint: a chat answer with thinking on (unset or true)
    may think first; when its prompt opened the block (`opens_reasoning`) it starts inside it.
    Prompts and chat with thinking off are constrained from their first token."""
    if not is_chat or enable_thinking is False:
        return "none"
    return "open" if starts_in_reasoning else "optional"


class ThinkFirstSplitter:
    """The text of a constraint's output with its think block (module docstring), as
    (reasoning, content) delta by delta: the block's reasoning trimmed as ReasoningSplitter
    trims it; the answer exactly as generated, past the SEPARATOR. Set `is_reasoning` before
    the first push when the prompt opened the block."""

    def __init__(self) -> None:
        self.is_reasoning = False
        self._block = ReasoningSplitter()
        self._at: Literal["start", "block", "separator", "answer"] = "start"
        self._pending = ""  # text not settled yet: a tag's possible beginning, the separator's
        self._separator = SEPARATOR  # what of it is still to drop

    def push(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text` completes; either may be ""."""
        if self._at == "answer":
            return "", text
        self._pending += text
        return self._advance(is_end=False)

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the generation."""
        return self._advance(is_end=True)

    def _advance(self, *, is_end: bool) -> tuple[str, str]:
        reasoning = ""
        if self._at == "start":
            if self.is_reasoning or self._pending.startswith(OPEN):
                self._block.is_reasoning = self.is_reasoning
                self._at = "block"  # the block splitter reads the tag itself
            elif OPEN.startswith(self._pending) and not is_end:
                return "", ""
            else:
                self._at = "answer"
        if self._at == "block":
            at = self._pending.find(CLOSE)
            if at < 0:
                held = 0 if is_end else _held_tail(self._pending)
                cut = len(self._pending) - held
                part, self._pending = self._pending[:cut], self._pending[cut:]
                reasoning = self._block.push(part)[0]
                if is_end:
                    reasoning += self._block.finish()[0]
                return reasoning, ""
            end = at + len(CLOSE)
            reasoning = self._block.push(self._pending[:end])[0]
            self._pending = self._pending[end:]
            self._at = "separator"
        if self._at == "separator":
            while self._separator and self._pending[:1] == self._separator[0]:
                self._pending, self._separator = self._pending[1:], self._separator[1:]
            if self._separator and not self._pending and not is_end:
                return reasoning, ""
            self._at = "answer"
        content, self._pending = self._pending, ""
        return reasoning, content
