"""Chat content is text: special-token strings a caller wrote stay characters, never control tokens.

A chat template wraps each message's content in control tokens (`<|im_start|>user\n` ...
`<|im_end|>`), and copies tool definitions and calls into it. Tokenizing the rendered prompt as
one string, as HF's `apply_chat_template` does, also turns a `<|im_end|>` typed inside the
content into the real token, so a user turn can close itself and open a system turn. Here the
template's own special tokens stay special and the content's are split into the ids of their
characters (HF's `split_special_tokens`, on the content only; "content" is every text a caller
gives: messages' content and reasoning, tool calls' names and arguments, tools' names,
descriptions and schemas). Only tokens marked special are affected; added tokens that are not
(Qwen3's `<think>`, `<tool_call>`) are matched in content as HF matches them.

How, in three steps (content without special-token strings takes none of them: the rendered
prompt is tokenized whole, exactly as HF does):

    1. each special-token string in a message becomes a marker  M<j>M  (M: a private-use
       character found in no message, j: which special token) and the template renders that;
    2. the rendered text is tokenized normally: its special tokens are the template's alone,
       and they cut it into pieces (the tokenizer encodes each piece on its own anyway);
    3. a piece holding markers gets them back as the original strings and is re-encoded with
       special-token matching off; every other piece keeps its ids.

    <|im_start|> "user\nhi M0M there" <|im_end|> "\n" <|im_start|> "assistant\n"
         ^ kept        ^ re-encoded: "hi <|im_start|> there", as characters       ^ kept
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from tokenizers import Encoding

from mili.errors import InvalidArgument, count_of
from services.tokenizer.chat_template import Message
from services.tokenizer.tools import Tool

# Markers are drawn from the supplementary private-use planes, highest first: characters no
# text or template has a reason to hold; one found in a message is skipped.
_MARKER_CANDIDATES = range(0x10FFFD, 0xF0000, -1)


class ChatPrompt(NamedTuple):
    prompt: str  # the rendered conversation
    token_ids: list[int]


class ContentGuard:
    """Finds special-token strings in chat content and encodes a conversation so that they
    stay text (see the module docstring)."""

    def __init__(self, special_tokens: Iterable[tuple[str, int]]) -> None:
        # Longest first, so that a token that is a prefix of another never shadows it.
        tokens = sorted(special_tokens, key=lambda t: -len(t[0]))
        self._texts = [text for text, _ in tokens if text]
        self._ids = frozenset(token_id for text, token_id in tokens if text)
        self._pattern = (
            re.compile("|".join(re.escape(t) for t in self._texts)) if self._texts else None
        )

    def finds_special_text(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> bool:
        if self._pattern is None:
            return False
        return any(self._pattern.search(text) for text in _texts_of(messages, tools))

    def encode(
        self,
        messages: Sequence[Message],
        tools: Sequence[Tool],
        render: Callable[[list[Message], list[Tool]], str],
        encode: Callable[[str], Encoding],
        encode_as_text: Callable[[list[str]], list[list[int]]],
    ) -> ChatPrompt:
        """Render and tokenize `messages`, the special-token strings of their content as text.

        render: (messages, tools) -> prompt (the chat template); encode: text -> Encoding with
        special tokens matched; encode_as_text: texts -> ids of each with special-token matching
        off.
        """
        assert self._pattern is not None  # callers check finds_special_text first
        pattern = self._pattern
        marker = _free_marker(messages, tools)
        index = {text: j for j, text in enumerate(self._texts)}

        def escape(text: str) -> str:
            return pattern.sub(lambda m: f"{marker}{index[m.group()]}{marker}", text)

        rendered = render(
            [m.map_text(escape) for m in messages], [t.map_text(escape) for t in tools]
        )
        markers = re.compile(f"{marker}(\\d+){marker}")

        def restore(text: str) -> str:
            restored = markers.sub(lambda m: self._texts[int(m.group(1))], text)
            if marker in restored:  # the template cut a marker in two (sliced the content)
                raise InvalidArgument(
                    "messages",
                    count_of(len(messages), "message"),
                    "the chat template does not keep the special-token strings of this "
                    "content whole; remove them, or set allow_special_tokens",
                )
            return restored

        encoding = encode(rendered)
        ids, offsets = encoding.ids, encoding.offsets
        # The template's special tokens cut the text into pieces, each tokenized on its own.
        parts: list[list[int]] = []
        redo: list[tuple[int, str]] = []  # (index in parts, restored text) of marked pieces
        start_token, start_char = 0, 0
        for i in [*(i for i, t in enumerate(ids) if t in self._ids), len(ids)]:
            end_char = offsets[i][0] if i < len(ids) else len(rendered)
            piece = rendered[start_char:end_char]
            if marker in piece:
                redo.append((len(parts), restore(piece)))
                parts.append([])
            else:
                parts.append(ids[start_token:i])
            if i < len(ids):
                parts.append([ids[i]])
                start_token, start_char = i + 1, offsets[i][1]
        for (k, _), piece_ids in zip(redo, encode_as_text([t for _, t in redo]), strict=True):
            parts[k] = piece_ids
        token_ids = [token_id for part in parts for token_id in part]
        return ChatPrompt(restore(rendered), token_ids)


def _texts_of(messages: Sequence[Message], tools: Sequence[Tool]) -> Iterable[str]:
    for m in messages:
        yield from m.texts()
    for t in tools:
        yield from t.texts()


def _free_marker(messages: Sequence[Message], tools: Sequence[Tool]) -> str:
    used: set[str] = set()  # one pass over the texts, not one per candidate
    for text in _texts_of(messages, tools):
        used.update(text)
    for code_point in _MARKER_CANDIDATES:
        if chr(code_point) not in used:
            return chr(code_point)
    raise InvalidArgument(
        "messages",
        f"{len(_MARKER_CANDIDATES)} private-use characters",
        "hold every character of U+F0001..U+10FFFD; at least one must stay unused",
    )
