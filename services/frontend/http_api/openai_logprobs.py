"""Log-probabilities in OpenAI's two formats, with token strings from the frontend's own
detokenizer (text.py: the tokenizer service's file, loaded here).

    completions  {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
                  "text_offset": [int]}        the chosen token is in its top dict too, as vLLM
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                  "logprob", "bytes"}]}], "refusal": null}

and vLLM's `prompt_logprobs` (either endpoint), one entry per prompt token:

    [null, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...]

A token's string is its bytes read as UTF-8, U+FFFD where they are only part of a character
(a byte-level token may be); `bytes` keeps them exact. `text_offset` indexes the choice's text
as returned: an echoed prompt is the prompt as sent, which the tokenizer's normalizer may have
changed before its tokens were made ("e\u0301" -> "é"), so the prompt's offsets are mapped back
onto it (mili/text/alignment.py).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from mili.engine.logprobs import TokenLogprobs
from mili.text.alignment import align
from services.frontend.pipeline import Delta
from services.frontend.text import LocalDetokenizer


class TokenPieces:
    """Token id -> (string, bytes), remembered for the request (top lists repeat ids)."""

    def __init__(self, detokenizer: LocalDetokenizer) -> None:
        self._detokenizer = detokenizer
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._pieces.get(token_id)
        if piece is None:
            raw = self._detokenizer.token_bytes(token_id)
            piece = self._pieces[token_id] = (raw.decode("utf-8", "replace"), list(raw))
        return piece

    def text(self, token_id: int) -> str:
        return self.piece(token_id)[0]

    def normalize(self, text: str) -> str:
        return self._detokenizer.normalize(text)

    def text_bytes(self, token_id: int, *, skip_special_tokens: bool) -> bytes:
        """What the token adds to a text decoded as `skip_special_tokens` says (a generation's
        text skips special tokens; an echoed prompt's keeps them)."""
        if skip_special_tokens:
            return self._detokenizer.token_bytes(token_id, skip_special_tokens=True)
        return bytes(self.piece(token_id)[1])


class TextOffsets:
    """Where each token's text starts in a choice's text, token after token (across deltas):
    the characters of the text that end before the token's first byte, from `start`. The
    bytes are those the text is decoded from (`TokenPieces.text_bytes`), read as UTF-8 the
    same way, U+FFFD for what is not valid. A byte-level token may carry only part of a
    character: it adds none, and the next token starts where that character lands (each
    part's own string, U+FFFD, is no character of the text). A token that adds no bytes (a
    special token the text skips) starts where the text so far ends."""

    def __init__(self, start: int = 0) -> None:
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, raw: bytes) -> int:
        """The offset of the next token, whose bytes are `raw`."""
        offset = self.at
        held, _ = self._decoder.getstate()
        if held and raw and not _continues(held, raw[0]):
            # The bytes held for a character are none: they read as one U+FFFD, which the
            # decoder writes only now, before this token's text.
            offset += 1
        self.at += len(self._decoder.decode(raw))
        return offset


def _continues(held: bytes, byte: int) -> bool:
    """Whether `byte` continues the start of a UTF-8 character `held`."""
    try:
        codecs.utf_8_decode(held + bytes([byte]), "strict", False)
    except UnicodeDecodeError:
        return False
    return True


def completion_logprobs(
    pieces: TokenPieces,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    offsets: TextOffsets,
    *,
    skip_special_tokens: bool = True,
) -> dict[str, Any]:
    """The completions format for these tokens; `offsets` goes on from where the choice's
    text (echoed prompt included) is, which skips special tokens or not as said."""
    tokens = [pieces.text(t) for t in token_ids]
    text_offset = [
        offsets.take(pieces.text_bytes(t, skip_special_tokens=skip_special_tokens))
        for t in token_ids
    ]
    tops = []
    for token, lp in zip(tokens, logprobs, strict=True):
        # Tokens may read as one string (the parts of characters all read U+FFFD): the dict
        # keeps the first, the most likely (lp.top is most likely first).
        top: dict[str, float] = {}
        for t, value in lp.top:
            top.setdefault(pieces.text(t), value)
        top.setdefault(token, lp.logprob)
        tops.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": text_offset,
    }
    return body


def prompt_completion_logprobs(
    pieces: TokenPieces,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs],
    echoed: str | None = None,
) -> dict[str, Any]:
    """The completions format for an echoed prompt: its first token has no logprob (nothing
    comes before it: null, as OpenAI and vLLM give it), each other token the one prefill
    computed; offsets count from the start of the prompt's text, `echoed` (the prompt as sent)
    where it is not the tokens' own text (None: it is)."""
    offsets = TextOffsets()  # over the tokens' text: special tokens kept, as echoed
    offsets.take(pieces.text_bytes(token_ids[0], skip_special_tokens=False))
    rest = completion_logprobs(pieces, token_ids[1:], logprobs, offsets, skip_special_tokens=False)
    text_offset = [0, *rest["text_offset"]]
    if echoed is not None:
        raw = b"".join(pieces.text_bytes(t, skip_special_tokens=False) for t in token_ids)
        tokens_text = raw.decode("utf-8", "replace")  # as `offsets` read it
        if echoed != tokens_text:
            # Normalized (NFD sent, NFC tokens): each offset to where its characters were sent.
            positions = align(echoed, tokens_text, pieces.normalize)
            if positions is not None:
                text_offset = [positions[i] for i in text_offset]
    return {
        "tokens": [pieces.text(token_ids[0]), *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": text_offset,
    }


def chat_logprobs(
    pieces: TokenPieces, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]
) -> dict[str, Any]:
    """The chat format for these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = pieces.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        item = entry(token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, value) for t, value in lp.top]
        content.append(item)
    return {"content": content, "refusal": None}


# What vLLM writes for a logprob of -inf (which JSON cannot carry) in prompt_logprobs.
_LOWEST_LOGPROB = -9999.0


def vllm_prompt_logprobs(
    pieces: TokenPieces, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs of a prompt (`logprobs`: those of its tokens after the first):
    null for the first token (nothing comes before it), then for each token a dict keyed by
    token id (a string, as JSON has it): the prompt token with its rank in the vocabulary,
    then the `num_top` most likely with ranks 1 to num_top. A prompt token among them is one
    entry, first, with the rank of its place in the top (vLLM writes the top over it: they
    differ only for a token tied with others). `decoded_token` is the token alone as text."""

    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        value = max(logprob, _LOWEST_LOGPROB)
        return {"logprob": value, "rank": rank, "decoded_token": pieces.text(token_id)}

    entries: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, lp in zip(token_ids[1:], logprobs, strict=True):
        at = {str(token_id): entry(token_id, lp.logprob, lp.rank)}
        for rank, (t, value) in enumerate(lp.top[:num_top], start=1):
            at[str(t)] = entry(t, value, rank)
        entries.append(at)
    return entries


def prompt_logprobs_of(
    pieces: TokenPieces, deltas: Sequence[Delta], num_top: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs of a generation's prompt, from its first delta (which carries the
    prompt's ids and logprobs when they were asked for); null without them."""
    first = deltas[0] if deltas else None
    if first is None or not first.prompt_token_ids:
        return None
    return vllm_prompt_logprobs(
        pieces, first.prompt_token_ids, first.prompt_logprobs or [], num_top
    )
