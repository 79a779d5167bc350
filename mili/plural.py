"""A count and its noun, as a log line or a message says it: `1 output token`, `2 output
tokens`, `0 output tokens`. One rule for every line that counts something, so none prints
"1 output tokens" and none grows a ternary of its own."""

from __future__ import annotations


def plural(num: int, noun: str, nouns: str | None = None) -> str:
    """`num` and `noun`, the noun singular for exactly one and plural otherwise (zero too):
    `nouns` where adding "s" is wrong.

    plural(1, "prompt token") == "1 prompt token"    plural(3, "time") == "3 times"
    plural(0, "request") == "0 requests"    plural(2, "process", "processes") == "2 processes"
    """
    return f"{num} {noun if num == 1 else nouns or noun + 's'}"
