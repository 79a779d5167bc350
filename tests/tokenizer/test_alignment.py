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
    marks = "q\u0301\u0323!"  # marks reordered, nothing composed: the cluster maps to its base
    assert nfc(marks) == "q\u0323\u0301!"
    assert align(marks, nfc(marks), nfc) == [0, 0, 0, 3, 4]


def test_other_normalizers_of_the_tokenizers_library() -> None:
    nfkc = normalizers.NFKC().normalize_str
    assert align("\ufb01ne", nfkc("\ufb01ne"), nfkc) == [0, 0, 1, 2, 3]  # the ligature "fi"
    lower = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]).normalize_str
    assert align("Éa", lower("Éa"), lower) == [0, 0, 1, 2]  # "É" -> "e" + U+0301


def test_a_normalized_text_that_is_not_the_sent_one_normalized_has_no_mapping() -> None:
    assert align("abc", "abd", nfc) is None
    assert align("ab", "abc", nfc) is None
    assert align("abc", "ab", nfc) is None
