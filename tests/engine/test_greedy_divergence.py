"""tests/engine/greedy_divergence.py, on plain CPU tensors: the helper behind the graph-vs-eager
GPU test's message (test_runner_gpu.py) must point at the right step, row and margin."""

from __future__ import annotations

import pytest
import torch

from tests.engine.greedy_divergence import (
    Divergence,
    describe_divergence,
    first_divergence,
    top2_margin,
)


def test_first_divergence_is_the_earliest_step_then_the_lowest_row() -> None:
    expected = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]
    # Row 0 parts at step 3, rows 1 and 2 at step 1: step 1, row 1 comes first.
    actual = [[5, 6, 7, 0], [1, 0, 0, 0], [9, 0, 9, 9]]
    assert first_divergence(expected, actual) == Divergence(step=1, row=1, expected=2, actual=0)
    assert first_divergence(expected, [list(r) for r in expected]) is None


def test_a_row_that_ends_early_diverges_where_it_ends() -> None:
    assert first_divergence([[1, 2, 3]], [[1, 2]]) == Divergence(2, 0, 3, None)
    with pytest.raises(ValueError, match="2 rows against 1"):
        first_divergence([[1], [2]], [[1]])


def test_top2_margin() -> None:
    assert top2_margin(torch.tensor([0.5, 3.0, 1.0, 2.75])) == pytest.approx(0.25)
    assert top2_margin(torch.tensor([4.0, 1.0, 4.0])) == 0.0  # a tie
    assert top2_margin(torch.tensor([1.0, 2.0], dtype=torch.bfloat16)) == 1.0


def test_describe_names_step_row_tokens_and_the_reference_margins() -> None:
    eager = [[3, 1], [2, 0]]
    graph = [[3, 1], [2, 3]]  # row 1 parts at step 1
    step0 = torch.zeros(2, 4)
    step1 = torch.tensor([[9.0, 0.0, 0.0, 0.0], [5.0, 0.0, 1.0, 4.75]])
    message = describe_divergence(eager, graph, [step0, step1], names=("eager", "graph"))
    assert message.startswith(
        "graph tokens first differ from eager at step 1 (0: sampled from prefill), row 1: "
        "eager 0, graph 3; eager top-2 logit margin there 0.25"
    ), message
    assert "graph's token 0.25 below eager's in eager's logits" in message
    assert "near tie is numeric noise" in message


def test_describe_a_wide_margin_and_a_missing_step() -> None:
    logits = [torch.tensor([[0.0, 7.5, -1.0]])]
    message = describe_divergence([[1]], [[2]], logits)
    assert "expected top-2 logit margin there 7.5" in message
    assert "actual's token 8.5 below expected's" in message
    assert "no expected logits recorded" in describe_divergence([[1, 1]], [[1, 2]], logits)
    assert describe_divergence([[1]], [[1]], logits) == "the tokens are equal"
