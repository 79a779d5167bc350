"""Stop strings, matched on the generated text as it streams in (and `clip_tokens`, the stop
rule on the token ids decode streams).

Text arrives in deltas, and a stop string may straddle them ("...Obser" + "vation:"), so the
matcher holds back the longest tail of the text that could still become a stop string:

    stop = "\\nUser:"          pushed: "Hi there\\nUs"  ->  emits "Hi there", holds "\\nUs"
                              pushed: "er: what"     ->  match: emits "", generation stops
                              (had it been "ed", it would emit "\\nUsed" and hold nothing)

Why holding the longest such tail is enough: a match that starts in text already emitted would
make the emitted part from its start a proper prefix of that stop string, i.e. a tail we held.
Strings are sequences of code points, so a multi-byte character is never split here (the
tokenizer's detokenizer never hands us half a character either).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from mili.engine.stop import FinishReason, check_stop


class Pushed(NamedTuple):
    text: str  # safe to send to the caller now
    is_stopped: bool  # a stop string matched: `text` ends right before it; stop generating


class StopMatcher:
    """One request's stop-string state. With no stop strings it passes text straight through."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self._is_stopped = False

    @property
    def is_stopped(self) -> bool:
        """A stop string matched."""
        return self._is_stopped

    @property
    def held(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._held

    def push(self, delta: str, *, may_stop: bool = True) -> Pushed:
        """Add generated text; return what may be emitted and whether a stop string matched.
        `may_stop` False (min_tokens not reached yet): nothing is matched nor held, and a
        match may start only in text pushed later."""
        if self._is_stopped:
            raise RuntimeError("push() after a stop string matched")
        if not self._stops:
            return Pushed(delta, False)
        text = self._held + delta
        if not may_stop:
            self._held = ""
            return Pushed(text, False)
        start = self._first_match(text)
        if start is not None:
            self._held = ""
            self._is_stopped = True
            return Pushed(text[:start], True)
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return Pushed(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The generation ended without a match: release the held text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> int | None:
        """Where the match that ends first starts (of two ending together, the longer): the
        one a character-by-character stream would have found, so the result does not depend
        on how decode cut the text into deltas ("\\nUser:" and "User" in "Hi\\nUser:": "Hi\\n")."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def clip_tokens(
    token_ids: Sequence[int], stop_token_ids: Collection[int], room: int
) -> tuple[int, FinishReason | None]:
    """How many of `token_ids` to keep, and the finish reason they cause (None = none).

    A stop id is kept and ends the generation; so does reaching `room` more tokens (the stop
    rule of mili.engine.stop). Decode applies the same rule; checking it here keeps the
    caller's contract if it did not.
    """
    if room <= 0:
        return 0, FinishReason.LENGTH
    for i, token_id in enumerate(token_ids):
        reason = check_stop(token_id, i + 1, stop_token_ids=stop_token_ids, max_tokens=room)
        if reason is not None:
            return i + 1, reason
    return len(token_ids), None
