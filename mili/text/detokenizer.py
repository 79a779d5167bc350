"""Incremental detokenization: token ids in, text deltas out, never half a character.

With byte-level BPE one character (an emoji, a CJK ideograph) can be split over several tokens;
decoding the tokens seen so far then ends in U+FFFD until the rest arrives. We keep two offsets
into the ids and re-decode only a short window:

    ids:  [ ... emitted ... | prefix window | read window (not yet emitted) ]
                            ^prefix_offset  ^read_offset                   ^len(ids)

    delta = decode(ids[prefix_offset:]) minus its prefix decode(ids[prefix_offset:read_offset])

and emit the delta only when it does not end in U+FFFD. Both offsets sit on character
boundaries, so the concatenated deltas equal one decode of all the ids. The cost per step is
the window, not the whole sequence, and so is the memory: ids before the prefix window are
dropped (a stream may run for millions of tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"
# Ids held back waiting for a character to complete, at most: a UTF-8 character is 4 bytes, a
# byte-level token at least one of them, so only a run of invalid bytes gets near this.
_MAX_HELD = 64


class IncrementalDetokenizer:
    """One stream's state. `decode(ids)` must be the tokenizer's (lossy) decode of `ids`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # the windows: ids from the prefix offset on
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ids; return the text they complete ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return everything held back, incomplete characters as U+FFFD (end of stream)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        # Past _MAX_HELD ids with nothing to emit (skipped special tokens, invalid bytes: as
        # U+FFFD) they go out anyway, not held and re-decoded for good. (Dropping ids that
        # decode to nothing at once is not safe: a Metaspace "▁" alone decodes to "" yet
        # gives the next token its space.)
        is_held = len(text) <= len(prefix) or text.endswith(_REPLACEMENT)
        if not final and is_held and len(self._ids) - self._read_offset <= _MAX_HELD:
            return ""
        del self._ids[: self._read_offset]  # emitted: the new prefix window starts there
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return text[len(prefix) :]
