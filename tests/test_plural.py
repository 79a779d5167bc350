"""`plural`: the one rule for a count and its noun in log lines and reports."""

from __future__ import annotations

from mili.plural import plural


def test_one_is_singular_and_every_other_count_plural() -> None:
    assert plural(1, "output token") == "1 output token"
    assert plural(0, "output token") == "0 output tokens"
    assert plural(2, "output token") == "2 output tokens"
    assert plural(1, "process", "processes") == "1 process"
    assert plural(3, "process", "processes") == "3 processes"
