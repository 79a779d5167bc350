"""The frontend's stop-string matcher per token: fed a decode event of 8 tokens at once (how it
ran before stop strings were matched a token at a time) against one token at a time (how a
request with stop strings runs now, so that the tokens after a stop are cut wherever decode's
events split). Text of 200k word-sized tokens, 4 stop strings that never match.

    .venv/bin/python benchmarks/stop_matcher.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # services, as a script

from services.frontend.stop import StopMatcher

STOPS = ["\nUser:", "</answer>", "###", "Observation:"]


def us_per_token(pieces: list[str], tokens_per_push: int) -> float:
    matcher = StopMatcher(STOPS)
    started = time.perf_counter()
    for i in range(0, len(pieces), tokens_per_push):
        matcher.push("".join(pieces[i : i + tokens_per_push]))
    return (time.perf_counter() - started) / len(pieces) * 1e6


def main() -> int:
    rng = random.Random(0)
    words = [
        "the",
        "of",
        "and",
        "model",
        "serving",
        "token",
        "stream",
        "prefill",
        "decode",
        "cache",
        "block",
        "kernel",
    ]
    pieces = [" " + rng.choice(words) for _ in range(200_000)]
    for _ in range(3):
        batched, single = us_per_token(pieces, 8), us_per_token(pieces, 1)
        print(f"per event of 8: {batched:.2f} us/token   per token: {single:.2f} us/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
