"""Log-probabilities reported for one generated token, or one prompt token (see
mili.engine.step.sampler for what they describe: the model's raw distribution, before penalties,
temperature and filters). Pure Python."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # (token_id, logprob) of the most likely tokens, most likely first
    # The chosen token's rank in the vocabulary (distribution.ranked_raw_logprobs: 1 for the
    # most likely); computed for prompt tokens only, 0 where it was not (generated tokens).
    rank: int = 0
