"""Detokenization in the frontend's own process, with the tokenizer service's own file.

The tokenizer service owns tokenization and chat templates; turning generated ids back into
text needs only its vocabulary and decoder, and doing that here saves a DetokenizeStream round
trip per token (docs/benchmarks.md, "Token path"). The frontend fetches tokenizer.json once
(GetTokenizerFile, again whenever Info's digest changes) and runs the very incremental
detokenizer the service runs (mili/text/detokenizer.py) on it, so the text is the same
byte for byte: never half a character, deltas that concatenate to one decode of all the ids.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders

from mili.text.byte_decoder import Decode, byte_decoders, byte_of_char
from mili.text.detokenizer import IncrementalDetokenizer


class LocalDetokenizer:
    """A tokenizer file, loaded; make one `LocalTextStream` per request from it."""

    def __init__(self, tokenizer_json: bytes, sha256: str) -> None:
        """Raises ValueError when the bytes are not the file `sha256` names, or not a tokenizer."""
        if hashlib.sha256(tokenizer_json).hexdigest() != sha256:
            raise ValueError("the tokenizer file does not match its SHA-256")
        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as e:  # the Rust loader raises a bare Exception with a parse message
            raise ValueError(f"not a tokenizer file: {e}") from None
        self.sha256 = sha256
        # The decode of a window of ids, by skip_special_tokens: a byte table's for a
        # byte-level vocabulary (Qwen's: no call into `tokenizers` per streamed token,
        # mili/text/byte_decoder.py), else the tokenizer's own. Made here, which the
        # frontend runs off its event loop.
        tokenizer = self._tokenizer
        self._decoders = byte_decoders(tokenizer) or {
            skip: functools.partial(_decode, tokenizer, skip) for skip in (False, True)
        }
        self._is_byte_level = type(tokenizer.decoder) is decoders.ByteLevel
        # What skip_special_tokens leaves out of a decode.
        self._special_ids = frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """All of `token_ids` at once (an echoed prompt's text)."""
        return self._decoders[skip_special_tokens](token_ids)

    def token_bytes(self, token_id: int, *, skip_special_tokens: bool = False) -> bytes:
        """One token's own bytes (b"" for an id it does not know, and for a special token when
        skipping them, as `decode` does): what OpenAI's logprobs call `bytes`. For a byte-level
        vocabulary they may be part of a UTF-8 character, which only the ids around it
        complete."""
        token = self._tokenizer.id_to_token(token_id)
        if token is None or (skip_special_tokens and token_id in self._special_ids):
            return b""
        if self._is_byte_level:
            chars = byte_of_char()
            # Added tokens are written in the byte alphabet too (byte_decoders checks it);
            # a character outside it is kept as its own UTF-8.
            return b"".join(bytes([chars[c]]) if c in chars else c.encode() for c in token)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def normalize(self, text: str) -> str:
        """`text` as the tokenizer's normalizer makes it before splitting it into tokens
        (Qwen3's: NFC), so as the tokens' own text reads it."""
        normalizer = self._tokenizer.normalizer
        return text if normalizer is None else normalizer.normalize_str(text)

    def stream(self, vocab_size: int, *, skip_special_tokens: bool = True) -> LocalTextStream:
        return LocalTextStream(self._decoders[skip_special_tokens], vocab_size)


def _decode(tokenizer: Tokenizer, skip_special_tokens: bool, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


class LocalTextStream:
    """One request's text, as `calls.TextStream`. Ids the tokenizer does not know are left out of
    the text, as the service's stream does (a model's embedding table is often padded past the
    vocabulary: Qwen3 has 151936 rows for 151669 tokens)."""

    def __init__(self, decode: Decode, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self._detokenizer = IncrementalDetokenizer(decode)

    async def push(self, token_ids: Sequence[int]) -> str:
        vocab_size = self._vocab_size
        return self._detokenizer.push([i for i in token_ids if i < vocab_size])

    async def finish(self) -> str:
        return self._detokenizer.flush()

    def cancel(self) -> None:
        pass  # nothing held outside this object
