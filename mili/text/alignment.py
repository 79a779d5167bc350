"""Where each character of a normalized text came from in the text it was normalized from.

A tokenizer's normalizer (Qwen3's and the demo model's: NFC) may change a prompt before it is
split into tokens: "e\u0301" (NFD, two characters) becomes "é" (one). The tokens' text is the
normalized text; an echoed prompt is the prompt as it was sent. So that a token's offset indexes
the prompt as sent, each position of the normalized text is mapped back:

    sent        c  a  f  e  ◌́  ␣  o  k
    normalized  c  a  f  é      ␣  o  k
    position    0  1  2  3      4  5  6  (7)   ->   0  1  2  3  5  6  7  (8)

Walked character by character: equal characters map one to one; where they differ, the sent
text's next cluster (a character and the combining marks after it), normalized alone, must be
what the normalized text has there, or a few clusters together (a composition that spans
clusters: Hangul jamo); the characters the normalizer kept at either end of that piece map to
where they were sent, the ones it changed to where the change begins.
Where nothing matches (a normalizer this does not follow), None: no mapping is guessed.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

# Clusters normalized together at most, for a composition that spans them (Hangul L V T: 3).
_MAX_CLUSTERS = 4


def align(sent: str, normalized: str, normalize: Callable[[str], str]) -> list[int] | None:
    """`positions[d]`: where the character `normalized[d]` starts in `sent`, for every d up to
    len(normalized) (that one: len(sent), the end); None where `normalize` does not make
    `normalized` of `sent` piece by piece."""
    positions: list[int] = []
    s = 0
    while len(positions) < len(normalized):
        d = len(positions)
        if s < len(sent) and sent[s] == normalized[d] and not _is_mark_after(sent, s + 1):
            positions.append(s)
            s += 1
            continue
        if s == len(sent):
            return None
        end = s
        for _ in range(_MAX_CLUSTERS):
            end = _cluster_end(sent, end)
            piece = normalize(sent[s:end])
            if normalized.startswith(piece, d):
                positions.extend(_piece_positions(sent[s:end], piece, s))
                s = end
                break
            if end == len(sent):
                return None
        else:
            return None
    if normalize(sent[s:]):  # what is left must be what the normalizer drops
        return None
    positions.append(len(sent))
    return positions


def _piece_positions(sent: str, piece: str, start: int) -> list[int]:
    """Where each character of `piece` (`sent`, which starts at `start`, normalized) starts:
    what the normalizer kept at either end of it stays where it was sent, what it changed
    between maps to where the change begins. A mark the normalizer left alone may be a token
    of its own (its base another), so it must not point at the base:

        sent   e  ◌́  ◌́    ->   é  ◌́        positions  s, s + 2
        sent   q  ◌́  ◌̣    ->   q  ◌̣  ◌́     positions  s, s + 1, s + 1  (marks reordered)
    """
    size = min(len(sent), len(piece))
    head = 0
    while head < size and sent[head] == piece[head]:
        head += 1
    tail = 0
    while tail < size - head and sent[-1 - tail] == piece[-1 - tail]:
        tail += 1
    changed = [start + head] * (len(piece) - head - tail)
    kept_tail = range(start + len(sent) - tail, start + len(sent))
    return [*range(start, start + head), *changed, *kept_tail]


def _cluster_end(text: str, start: int) -> int:
    """The end of the cluster at `start`: its character and the combining marks after it."""
    end = min(start + 1, len(text))
    while _is_mark_after(text, end):
        end += 1
    return end


def _is_mark_after(text: str, i: int) -> bool:
    return i < len(text) and unicodedata.combining(text[i]) != 0
