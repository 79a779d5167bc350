"""Where two runs' greedy tokens first part, and how close the reference run's logits were
there: a top-2 margin near zero means a tie flipped (numeric noise between two correct
computations), a wide one that one run computes something else (a real bug).

    tokens[row][step]     one list per sequence; step 0 is the token sampled from prefill
    logits[step]          [rows, vocab] the reference run's logits that step sampled from
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Divergence(NamedTuple):
    step: int
    row: int
    expected: int | None  # None: that run ended its row earlier
    actual: int | None


def first_divergence(
    expected: Sequence[Sequence[int]], actual: Sequence[Sequence[int]]
) -> Divergence | None:
    """The earliest step at which some row differs (its lowest such row), None if none does:
    later steps of a row that has parted are fed different tokens, so only the first counts."""
    if len(expected) != len(actual):
        raise ValueError(f"{len(expected)} rows against {len(actual)}")
    num_steps = max((len(r) for r in (*expected, *actual)), default=0)
    for step in range(num_steps):
        for row, (e, a) in enumerate(zip(expected, actual, strict=True)):
            e_token = e[step] if step < len(e) else None
            a_token = a[step] if step < len(a) else None
            if e_token != a_token:
                return Divergence(step, row, e_token, a_token)
    return None


def top2_margin(logits: torch.Tensor) -> float:
    """logits [vocab]: the largest logit minus the runner-up (0.0 for a tie)."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def describe_divergence(
    expected: Sequence[Sequence[int]],
    actual: Sequence[Sequence[int]],
    expected_logits: Sequence[torch.Tensor],
    *,
    names: tuple[str, str] = ("expected", "actual"),
) -> str:
    """An assertion message: where the tokens first differ and the reference's logit margins
    there (`names`: what to call the two runs)."""
    found = first_divergence(expected, actual)
    if found is None:
        return "the tokens are equal"
    e_name, a_name = names
    where = (
        f"{a_name} tokens first differ from {e_name} at step {found.step} "
        f"(0: sampled from prefill), row {found.row}: "
        f"{e_name} {found.expected}, {a_name} {found.actual}"
    )
    if found.step >= len(expected_logits):
        return where + f"; no {e_name} logits recorded for that step"
    row_logits = expected_logits[found.step][found.row].float()  # [vocab]
    margin = top2_margin(row_logits)
    text = f"{where}; {e_name} top-2 logit margin there {margin:.6g}"
    if found.expected is not None and found.actual is not None:
        gap = float(row_logits[found.expected] - row_logits[found.actual])
        text += f", {a_name}'s token {gap:.6g} below {e_name}'s in {e_name}'s logits"
    return text + " (a near tie is numeric noise, a wide margin a real bug)"
