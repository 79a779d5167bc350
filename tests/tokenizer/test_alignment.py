"""align: each position of a normalized text mapped back to the text as it was sent, with the
normalizers tokenizers apply (Qwen3's NFC, and others), exact positions."""

from __future__ import annotations

import unicodedata

from tokenizers import normalizers

from mili.text.alignment import align


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def test_an_nfd_prompt_maps_each_composed_character_to_where_its_base_was_sent() -> None:
    sent = "cafe\u0301 de\u0301ja\u0300"  # e + combining acute, a + combining grave
    normalized = nfc(sent)
    assert normalized == "café déjà"
    #            c  a  f  é  ␣  d  é  j  à  end
    assert align(sent, normalized, nfc) == [0, 1, 2, 3, 5, 6, 7, 9, 10, 12]


def test_text_the_normalizer_leaves_alone_maps_one_to_one() -> None:
    for sent in ["plain ascii", "日本語 😀👍🏽", "café (already NFC)", ""]:
        assert align(sent, nfc(sent), nfc) == list(range(len(sent) + 1))


def test_compositions_that_span_clusters_and_reorderings() -> None:
    jamo = "\u1100\u1161\u11a8x"  # Hangul L V T (each its own cluster) -> one syllable
    assert nfc(jamo) == "\uac01x"
    assert align(jamo, nfc(jamo), nfc) == [0, 3, 4]
    marks = "q\u0301\u0323!"  # marks reordered, nothing composed: to where the marks begin
    assert nfc(marks) == "q\u0323\u0301!"
    assert align(marks, nfc(marks), nfc) == [0, 1, 1, 3, 4]


def test_marks_the_normalizer_leaves_alone_keep_their_own_positions() -> None:
    """A cluster the normalizer matched mapped every character to its base: "q\u0301" (no
    composed form) read [0, 0] once another part of the prompt was composed (in a prompt NFC
    leaves alone the mark's offset is its own), and in "e\u0301\u0301" the second mark, left
    after "é", pointed at the "e". A mark may be a token of its own, whose offset then read
    its base."""
    sent = "e\u0301 q\u0301 e\u0301\u0301x"
    assert nfc(sent) == "é q\u0301 é\u0301x"
    #                          é  ␣  q  ◌́  ␣  é  ◌́  x  end
    assert align(sent, nfc(sent), nfc) == [0, 2, 3, 4, 5, 6, 8, 9, 10]


def test_other_normalizers_of_the_tokenizers_library() -> None:
    nfkc = normalizers.NFKC().normalize_str
    assert align("\ufb01ne", nfkc("\ufb01ne"), nfkc) == [0, 0, 1, 2, 3]  # the ligature "fi"
    lower = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]).normalize_str
    assert align("Éa", lower("Éa"), lower) == [0, 0, 1, 2]  # "É" -> "e" + U+0301


def test_a_normalized_text_that_is_not_the_sent_one_normalized_has_no_mapping() -> None:
    assert align("abc", "abd", nfc) is None
    assert align("ab", "abc", nfc) is None
    assert align("abc", "ab", nfc) is None
