"""`decode` for byte-level BPE tokenizers (Qwen's, GPT-2's) without a call into `tokenizers`.

A byte-level vocabulary writes every token as printable characters, one per byte (GPT-2's
byte -> character map), and its ByteLevel decoder maps them back and reads the bytes as UTF-8,
U+FFFD for what is not valid. So decoding ids is: look up each id's bytes in a table made once,
join them, decode. The incremental detokenizer decodes a short window of ids per streamed token,
twice; through `Tokenizer.decode` each call costs tens of microseconds, here about one
(docs/benchmarks.md, "Token path").

    ids [35, 1704, 9]  ->  table[35] + table[1704] + table[9]  ->  bytes.decode("utf-8", "replace")

Only for a tokenizer whose decoder is exactly ByteLevel and whose every token (added ones too,
e.g. "<think>") is written in that alphabet; otherwise `byte_decoders` returns None and callers
keep `Tokenizer.decode`. tests/tokenizer/test_byte_decoder.py checks equality with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from tokenizers import Tokenizer, decoders

Decode = Callable[[Sequence[int]], str]


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's printable character -> byte map: printable Latin-1 stands for itself, the other
    bytes (controls, space, 0x7F-0xA0, 0xAD) for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    mapping = {chr(b): b for b in printable}
    mapping.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return mapping


def byte_decoders(tokenizer: Tokenizer) -> dict[bool, Decode] | None:
    """skip_special_tokens -> a function equal to `tokenizer.decode(ids, skip_special_tokens)`,
    or None when the tokenizer is not plain byte-level. Ids the tokenizer does not know decode
    to nothing, as there. Builds one table of every token's bytes (~0.6 s for a 151k-token
    vocabulary on this project's 2-core CPU: call it off the event loop)."""
    if type(tokenizer.decoder) is not decoders.ByteLevel:
        return None
    chars = byte_of_char()
    vocab = tokenizer.get_vocab(with_added_tokens=True)  # token text -> id
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    try:
        for text, token_id in vocab.items():
            table[token_id] = bytes([chars[c] for c in text])
    except KeyError:
        return None  # a token outside the byte alphabet: leave it to the tokenizer's decoder
    skipping = table.copy()  # the same bytes objects; special tokens' emptied
    for token_id, token in tokenizer.get_added_tokens_decoder().items():
        if token.special:
            skipping[token_id] = b""
    return {False: _decode_with(table), True: _decode_with(skipping)}


def _decode_with(table: list[bytes]) -> Decode:
    size = len(table)

    def decode(ids: Sequence[int]) -> str:
        try:
            joined = b"".join([table[i] for i in ids])
        except IndexError:  # an id past the vocabulary (a padded embedding table's)
            joined = b"".join([table[i] for i in ids if 0 <= i < size])
        return joined.decode("utf-8", "replace")

    return decode
