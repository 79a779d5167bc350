"""Incremental detokenization never splits a character and adds up to a one-shot decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mili.text.detokenizer import IncrementalDetokenizer
from services.tokenizer.tokenizer import ModelTokenizer


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(demo_model_dir)


def _stream(tokenizer: ModelTokenizer, ids: list[int], chunks: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(lambda window: tokenizer.decode(window, skip))
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    deltas.append(detok.flush())
    return deltas


def test_emoji_split_over_tokens_is_held_back(tokenizer: ModelTokenizer) -> None:
    text = "ok 🙂👩‍💻 服务器 done"
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids, [1] * len(ids), skip=False)
    assert "".join(deltas) == text
    # Some emoji byte runs really are split over tokens here (the test would be vacuous otherwise).
    assert any(delta == "" for delta in deltas[:-1])
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # a str with lone surrogates would raise


@pytest.mark.parametrize("seed", range(40))
def test_random_id_streams_add_up_to_one_shot_decode(tokenizer: ModelTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 200))]
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.choice([1, 1, 1, 2, 3, 7])))
        left -= chunks[-1]
    skip = seed % 2 == 1
    deltas = _stream(tokenizer, ids, chunks, skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip)
    for delta in deltas[:-1]:
        delta.encode("utf-8")
        # Only a byte sequence that is invalid for good (followed by more text) may show as
        # U+FFFD mid-stream; a delta never ends in a character still being completed.
        assert not delta.endswith("\ufffd")


def test_a_long_stream_holds_only_its_window(tokenizer: ModelTokenizer) -> None:
    """Memory stays the window's, not the stream's (a DetokenizeStream without `final`)."""
    detokenizer = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids))
    ids = tokenizer.encode("gRPC streams text. " * 50)
    text = "".join(detokenizer.push([i]) for i in ids * 20) + detokenizer.flush()
    assert text == tokenizer.decode(ids * 20)
    assert len(detokenizer._ids) <= 8


def test_ids_that_never_complete_text_are_not_held_for_good() -> None:
    """Skipped special tokens add no text and a run of invalid bytes never completes one: the
    window once grew with each (memory, and a decode of the whole window per push)."""

    def decode(ids: list[int]) -> str:  # a byte-level vocabulary; id 999 a skipped special
        return bytes(i for i in ids if i != 999).decode("utf-8", errors="replace")

    for token in (999, 0x80):
        detokenizer = IncrementalDetokenizer(decode)
        ids = [token] * 4000
        text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
        assert text == decode(ids)
        assert len(detokenizer._ids) <= 2 * 64 + 1  # the prefix window and what it holds


def test_a_token_that_decodes_to_nothing_still_shapes_the_next() -> None:
    """A Metaspace vocabulary's bare "▁" decodes to "" alone yet gives the next token its
    space; after a run of invalid bytes a character still comes out whole."""
    pieces = {1: "\u2581", 2: "\u2581Hello", 3: "b"}

    def metaspace(ids: list[int]) -> str:  # as HF's Metaspace decoder: the first space dropped
        text = "".join(pieces[i] for i in ids).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text

    def byte_level(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    for decode, ids in (
        (metaspace, [1, 2]),
        (metaspace, [1, 1, 3]),
        (byte_level, [0xFF] * 70 + [0xE2, 0x82, 0xAC, ord("a")]),  # then "€a"
    ):
        detokenizer = IncrementalDetokenizer(decode)
        text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
        assert text == decode(ids), ids


def test_skip_special_tokens_drops_control_tokens_only(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nyes<|im_end|>")
    assert "".join(_stream(tokenizer, ids, [1] * len(ids), skip=True)) == (
        "assistant\n<think>\nhm\n</think>\n\nyes"
    )
