"""One request's tokens and progress as the engine's loops see them (single-process `generate()`
and decode's batch thread alike).

    prompt_token_ids   output_token_ids (sampling.output_token_ids: penalties and the seeded
    p0 p1 ... pn-1  |  o1 o2 ... ok        noise position read the same list)
    └──────────────── num_tokens ─────┘
    num_computed_tokens: positions whose K/V is in the cache; block_table covers them

`append` records a sampled token and applies the one stop rule (mili.engine.stop); a
constrained request's matcher accepts it first (ConstraintMatcher.refusal's error when it
cannot) and a finished match stops the generation.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from mili.engine.constraint.matcher import ConstraintMatcher
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.sampler import SequenceSampling
from mili.engine.stop import FinishReason, check_stop, stop_token_set


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    sampling: SequenceSampling  # params, seed and the output token ids
    stop_token_ids: frozenset[int]  # the request's own plus the model's EOS ids (unless ignored)
    max_context_tokens: int | None = None  # None: only max_tokens ends it
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    # The request's constraint state (None: unconstrained): masks its tokens, accepts each one.
    matcher: ConstraintMatcher | None = None

    @classmethod
    def new(
        cls,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        vocab_size: int,
        eos_token_ids: Collection[int],
        max_context_tokens: int | None = None,
        block_table: list[int] | None = None,
        matcher: ConstraintMatcher | None = None,
    ) -> Sequence:
        """Raises ValueError for a prompt id outside the vocabulary."""
        prompt = list(prompt_token_ids)
        stops = stop_token_set(params.stop_token_ids, eos_token_ids, ignore_eos=params.ignore_eos)
        return cls(
            prompt_token_ids=prompt,
            sampling=SequenceSampling(params, prompt, vocab_size, stop_token_ids=stops),
            stop_token_ids=stops,
            max_context_tokens=max_context_tokens,
            block_table=[] if block_table is None else block_table,
            matcher=matcher,
        )

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def written_token_ids(self) -> list[int]:
        """The tokens whose K/V is in the cache: all but the newest, which is never fed back
        until the next step (positions [0, num_tokens - 1))."""
        return (self.prompt_token_ids + self.output_token_ids)[: self.num_tokens - 1]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def is_length_bound(self) -> bool:
        """Whether the next token, whichever it is, reaches a length limit (max_tokens, the
        context): a step launched before it reaches the host must leave this one out."""
        if len(self.output_token_ids) + 1 >= self.params.max_tokens:
            return True
        limit = self.max_context_tokens
        return limit is not None and self.num_tokens + 1 >= limit

    def append(self, token_id: int) -> FinishReason | None:
        """Record the next output token; return the finish reason it causes (also kept in
        `finish_reason`). Raises ValueError for an id outside the vocabulary; for a token the
        request's constraint does not allow (nothing recorded), ConstraintError,
        ResourceExhausted where the grammar engine ran out of one of its limits, or
        InvalidArgument where the grammar is at a dead end (matcher.refusal)."""
        is_constraint_finished = False
        if self.matcher is not None:
            if not self.matcher.accept(token_id):
                where = f"output position {len(self.output_token_ids)}"
                raise self.matcher.refusal(token_id, where)
            is_constraint_finished = self.matcher.is_finished
        self.sampling.append(token_id)
        self.finish_reason = check_stop(
            token_id,
            len(self.output_token_ids),
            stop_token_ids=self.stop_token_ids,
            max_tokens=self.params.max_tokens,
            num_tokens=self.num_tokens,
            max_context_tokens=self.max_context_tokens,
            is_constraint_finished=is_constraint_finished,
        )
        return self.finish_reason
