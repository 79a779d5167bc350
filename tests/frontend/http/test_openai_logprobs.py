"""The completions logprobs' text_offset: where each token's text starts in the choice's text,
byte-level tokens that carry part of a character included."""

from __future__ import annotations

from typing import Any

from mili.engine.logprobs import TokenLogprobs
from services.frontend.http_api.openai_logprobs import (
    TextOffsets,
    TokenPieces,
    completion_logprobs,
    prompt_completion_logprobs,
)

# id -> bytes: "a", the emoji in two parts, "b", 世 in two parts, "c"
BYTES = [b"a", b"\xf0\x9f", b"\x98\x80", b"b", b"\xe4", b"\xb8\x96", b"c"]
TEXT = "a\U0001f600b世c"


class Bytes:
    def token_bytes(self, token_id: int) -> bytes:
        return BYTES[token_id]


def pieces() -> TokenPieces:
    return TokenPieces(Bytes())  # type: ignore[arg-type]


def lps(n: int) -> list[TokenLogprobs]:
    return [TokenLogprobs(-1.0, []) for _ in range(n)]


def test_a_token_that_carries_part_of_a_character_starts_where_that_character_lands() -> None:
    """Offsets counted each part's U+FFFD as a character: "c" was at 7 in a 5-character text."""
    ids = list(range(len(BYTES)))
    body: dict[str, Any] = completion_logprobs(pieces(), ids, lps(len(ids)), TextOffsets())
    assert body["text_offset"] == [0, 1, 1, 2, 3, 3, 4]
    assert [TEXT[o] for o in body["text_offset"]] == ["a", *"\U0001f600" * 2, "b", *"世世", "c"]
    for cut in range(len(ids) + 1):  # streamed: the same offsets across deltas
        offsets, got = TextOffsets(), []
        for part in (ids[:cut], ids[cut:]):
            got += completion_logprobs(pieces(), part, lps(len(part)), offsets)["text_offset"]
        assert got == body["text_offset"], cut
    echoed = prompt_completion_logprobs(pieces(), ids, lps(len(ids) - 1))
    assert echoed["text_offset"] == body["text_offset"]
    after_echo = completion_logprobs(pieces(), [6], lps(1), TextOffsets(len(TEXT)))
    assert after_echo["text_offset"] == [5]


def test_top_tokens_that_read_as_one_string_keep_the_most_likely_logprob() -> None:
    """Found by an exploratory test: the byte-level parts of characters all read "\ufffd", and
    each later (less likely) one overwrote the one before: the top dict showed the lowest."""
    top = [(1, -0.5), (0, -1.0), (4, -2.0)]  # most likely first; 1 and 4 read "\ufffd"
    body = completion_logprobs(pieces(), [4], [TokenLogprobs(-2.0, top)], TextOffsets())
    assert body["top_logprobs"] == [{"\ufffd": -0.5, "a": -1.0}]
