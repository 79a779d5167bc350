"""The byte-table decode of a byte-level vocabulary is the tokenizer's own decode, id for id,
and tokenizers it cannot serve are left to their own decoder."""

from __future__ import annotations

import asyncio
import hashlib
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mili.demo import tokenizer as demo_tokenizer
from mili.text.byte_decoder import byte_decoders, byte_of_char
from services.frontend.text import LocalDetokenizer


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return demo_tokenizer.train_tokenizer()


def test_the_byte_alphabet_is_gpt2s(demo: Tokenizer) -> None:
    alphabet = byte_of_char()
    assert sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert (alphabet["A"], alphabet["Ġ"], alphabet["Ċ"]) == (0x41, 0x20, 0x0A)


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_byte_table_decode_equals_the_tokenizers(
    demo: Tokenizer, skip_special_tokens: bool, seed: int
) -> None:
    decoders_ = byte_decoders(demo)
    assert decoders_ is not None
    decode = decoders_[skip_special_tokens]
    size = demo.get_vocab_size(with_added_tokens=True)
    rng = random.Random(seed)
    text = "ok 🙂👩‍💻 服务器 <think>\nhm</think> done<|im_end|>"
    samples = [demo.encode(text).ids, [], list(range(size))]
    # Arbitrary ids: lone bytes 0x80-0xFF (invalid UTF-8), special and added tokens, and ids
    # past the vocabulary (a padded embedding table's), which decode to nothing.
    samples += [[rng.randrange(size + 8) for _ in range(rng.randint(1, 16))] for _ in range(500)]
    for ids in samples:
        assert decode(ids) == demo.decode(ids, skip_special_tokens=skip_special_tokens), ids
    # The first byte of a three-byte character, then "A": one U+FFFD, as the tokenizer has it.
    char_of = {byte: char for char, byte in byte_of_char().items()}
    broken = [demo.token_to_id(char_of[0xE4]), demo.token_to_id("A")]
    assert None not in broken
    broken_ids = [i for i in broken if i is not None]
    assert decode(broken_ids) == "\ufffdA" == demo.decode(broken_ids)


def _word_level(decoder: object) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.decoder = decoder  # type: ignore[assignment]
    return tokenizer


def test_tokenizers_it_cannot_serve_keep_their_own_decode(demo: Tokenizer) -> None:
    assert byte_decoders(_word_level(decoders.WordPiece())) is None
    assert byte_decoders(_word_level(decoders.Sequence([decoders.ByteLevel()]))) is None
    spaced = demo_tokenizer.train_tokenizer()
    spaced.add_tokens([AddedToken("two words", special=False, normalized=False)])  # a raw space
    assert byte_decoders(spaced) is None
    # The frontend's detokenizer then decodes with the tokenizer itself, still exactly.
    local = LocalDetokenizer(spaced.to_str().encode(), _sha256(spaced.to_str().encode()))
    ids = spaced.encode("say two words").ids
    stream = local.stream(spaced.get_vocab_size(with_added_tokens=True), skip_special_tokens=False)

    async def run() -> str:
        return await stream.push(ids) + await stream.finish()

    assert asyncio.run(run()) == spaced.decode(ids) == "say two words"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
