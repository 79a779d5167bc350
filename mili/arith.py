"""Integer arithmetic written once (pure)."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """`a / b` rounded up, for `b > 0`: how many `b`-sized pieces cover `a`.

    ceil_div(10, 4) == 3    ceil_div(8, 4) == 2    ceil_div(0, 4) == 0
    """
    return -(-a // b)
