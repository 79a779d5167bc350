"""The completions logprobs' text_offset: where each token's text starts in the choice's text,
byte-level tokens that carry part of a character included."""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import random
import unicodedata
from typing import Any

import pytest

from mili.demo import tokenizer as demo_tokenizer
from mili.engine.logprobs import TokenLogprobs
from mili.text.byte_decoder import byte_of_char
from services.frontend.http_api.openai_logprobs import (
    TextOffsets,
    TokenPieces,
    completion_logprobs,
    prompt_completion_logprobs,
)
from services.frontend.text import LocalDetokenizer

# id -> bytes: "a", the emoji in two parts, "b", 世 in two parts, "c"
BYTES = [b"a", b"\xf0\x9f", b"\x98\x80", b"b", b"\xe4", b"\xb8\x96", b"c"]
TEXT = "a\U0001f600b世c"


class Bytes:
    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes:
        return BYTES[token_id]  # none special


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


@pytest.fixture(scope="module")
def demo() -> LocalDetokenizer:
    raw = demo_tokenizer.train_tokenizer().to_str().encode()
    return LocalDetokenizer(raw, hashlib.sha256(raw).hexdigest())


_SPANS: list[tuple[int, int]] = []  # the byte spans the last decode read as U+FFFD


def _replace_recording(error: UnicodeError) -> tuple[str, int]:
    assert isinstance(error, UnicodeDecodeError)
    _SPANS.append((error.start, error.end))
    return "\ufffd", error.end


codecs.register_error("test-offsets-replace", _replace_recording)


def _starts(data: bytes, token_starts: list[int]) -> list[int]:
    """For each byte position, how many characters of data's text (UTF-8, U+FFFD for what is
    not valid) end at or before it: where a token starting there begins in the text."""
    _SPANS.clear()
    text = data.decode("utf-8", "test-offsets-replace")
    ends, at, spans = [], 0, list(_SPANS)
    for char in text:
        if spans and spans[0][0] == at:
            at = spans.pop(0)[1]
        else:
            at += len(char.encode())
        ends.append(at)
    return [sum(end <= start for end in ends) for start in token_starts]


def _generate(local: LocalDetokenizer, ids: list[int], cut: int) -> tuple[str, list[int]]:
    """A generation's text as the frontend streams it, and its offsets, in two deltas."""
    stream, pieces, offsets = local.stream(1 << 20), TokenPieces(local), TextOffsets()

    async def run() -> tuple[str, list[int]]:
        text, got = "", []
        for part in (ids[:cut], ids[cut:]):
            text += await stream.push(part)
            got += completion_logprobs(pieces, part, lps(len(part)), offsets)["text_offset"]
        return text + await stream.finish(), got

    return asyncio.run(run())


def test_offsets_are_where_each_token_begins_in_the_text_the_frontend_writes(
    demo: LocalDetokenizer,
) -> None:
    """Found by an exploratory test: a special token the text skips was counted in the offsets
    (every later one shifted by its length), and a token after a byte that starts no character
    got the offset of that byte's U+FFFD (the decoder writes it only once the next byte
    arrives). The generation's text skips special tokens; an echoed prompt's keeps them."""
    char_of = {byte: char for char, byte in byte_of_char().items()}
    lead = demo._tokenizer.token_to_id(char_of[0xD0])  # starts a two-byte character
    im_start = demo._tokenizer.token_to_id("<|im_start|>")
    [a], [b], [cyrillic_l], [c] = (demo._tokenizer.encode(x).ids for x in "abлc")
    ids = [a, im_start, b, lead, cyrillic_l, c]
    text, offsets = _generate(demo, ids, 3)
    assert text == "ab\ufffdлc"
    assert offsets == [0, 1, 1, 2, 3, 4]
    echoed = prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1))
    assert demo.decode(ids) == "a<|im_start|>b\ufffdлc"
    assert echoed["text_offset"] == [0, 1, 13, 14, 15, 16]

    # Any ids: lone bytes (lead and continuation), special and added tokens, words.
    rng = random.Random(0)
    size = demo._tokenizer.get_vocab_size(with_added_tokens=True)
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            raw = [demo.token_bytes(t, skip_special_tokens=skip) for t in ids]
            starts = [sum(len(r) for r in raw[:i]) for i in range(len(ids))]
            expected = _starts(b"".join(raw), starts)
            for i, start in enumerate(starts):
                if not raw[i]:  # where the text so far ends: a held character still uncounted
                    so_far = codecs.getincrementaldecoder("utf-8")("replace")
                    expected[i] = len(so_far.decode(b"".join(raw)[:start]))
            if skip:
                text, offsets = _generate(demo, ids, rng.randint(0, len(ids)))
                assert text == demo.decode(ids, skip_special_tokens=True), ids
                assert offsets == expected, ids
            else:
                echoed = prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1))
                assert echoed["text_offset"] == expected, ids


def test_an_echoed_prompt_the_normalizer_changed_is_indexed_as_it_was_sent(
    demo: LocalDetokenizer,
) -> None:
    """The demo tokenizer (as Qwen3's) normalizes to NFC: an NFD prompt's tokens read "é" where
    the prompt as sent, which echo returns, has "e" + U+0301. Offsets counted the tokens' text
    and fell one short per composed character; each now points where its characters were
    sent. A prompt the normalizer leaves alone keeps the offsets of its tokens' text."""
    sent = "cafe\u0301 de\u0301ja\u0300 vu"
    ids = demo._tokenizer.encode(sent).ids
    assert demo.decode(ids) == unicodedata.normalize("NFC", sent) != sent
    echoed = prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1), sent)
    pairs = list(zip(echoed["tokens"], echoed["text_offset"], strict=True))
    for token, offset in pairs:  # a part of a character (U+FFFD): its whole ones before it
        whole = token.split("\ufffd")[0]
        assert unicodedata.normalize("NFC", sent[offset:]).startswith(whole), pairs
    assert [o for t, o in pairs if t == "é"] == [3, 7]
    assert [o for t, o in pairs if t == "\ufffd"] == [10, 10]  # "à", in two byte tokens
    plain = "déjà vu 日本"
    ids = demo._tokenizer.encode(plain).ids
    as_sent = prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1), plain)
    assert as_sent == prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1))


def test_a_mark_the_normalizer_left_alone_keeps_its_offset_when_another_was_composed(
    demo: LocalDetokenizer,
) -> None:
    """ "q\u0301" has no composed form: in a prompt NFC leaves alone, the mark's byte tokens
    start at the mark. Once another character of the prompt was composed ("e\u0301" -> "é"),
    the alignment mapped the mark's tokens to the "q" (one offset short of where they start in
    the same prompt sent precomposed, shifted by the one extra character sent)."""
    composed = "caf\u00e9 q\u0301 ok"  # NFC already: offsets of its tokens' own text
    sent = "cafe\u0301 q\u0301 ok"  # the same tokens; one character more before the "q"
    ids = demo._tokenizer.encode(sent).ids
    assert ids == demo._tokenizer.encode(composed).ids
    plain = prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1), composed)
    echoed = prompt_completion_logprobs(TokenPieces(demo), ids, lps(len(ids) - 1), sent)
    shifted = [o + 1 if o > 3 else o for o in plain["text_offset"]]
    pairs = list(zip(echoed["tokens"], echoed["text_offset"], strict=True))
    assert echoed["text_offset"] == shifted, pairs
