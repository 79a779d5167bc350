"""The batch thread's records: a request whose KV landed, about to join (`Join`); a request in
the running batch (`Running`); a launched decode step until its ids are in (`Step`). Batch
thread only (batcher.py), but for `Join`, which `Batcher.join` queues from any thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Span

from mili.engine.constraint.matcher import ConstraintError, ConstraintMatcher
from mili.engine.logprobs import TokenLogprobs
from mili.engine.step.sampler import PendingSample
from mili.engine.step.sequence import Sequence
from mili.errors import FailedPrecondition, ResourceExhausted
from mili.telemetry.tracing import start_batch_span
from services.decode.requests import DecodeRequest, RequestTable
from services.decode.stream import Outlet, TokenEvent

_LOG = logging.getLogger("mili.decode")
_TRACER = trace.get_tracer("mili.decode")  # a no-op until tracing installs a provider


@dataclass(frozen=True)
class Join:
    """A RUNNING request (its KV in the cache) and prefill's first token, for the next step."""

    request: DecodeRequest
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    outlet: Outlet

    def start(
        self, *, vocab_size: int, eos_token_ids: frozenset[int], max_context_tokens: int
    ) -> tuple[Sequence, TokenEvent]:
        """The request's engine sequence with the first token appended, and that token's
        event (with a finish reason when it already ends the request). Raises what fails the
        request alone: FailedPrecondition when the constraint refuses the token prefill drew
        by the same grammar, ResourceExhausted when the grammar is too complex here, and any
        other error a bug raised (logged)."""
        request = self.request
        try:
            seq = Sequence.new(
                request.prompt_token_ids,
                request.params,
                vocab_size=vocab_size,
                eos_token_ids=eos_token_ids,
                max_context_tokens=max_context_tokens,
                # The whole reservation: the runner copies it to the device once, and reads
                # only the blocks under each step's position.
                block_table=request.block_table,
                matcher=request.matcher,
            )
            reason = seq.append(self.first_token_id)
        except (ValueError, ResourceExhausted):  # ValueError: validated at the transfer edge,
            raise  # a bug if it happens
        except ConstraintError as e:  # prefill masked it by the same grammar: they disagree
            why = f"prefill's first token does not fit the constraint here: {e}"
            raise FailedPrecondition(why) from e
        except Exception:  # a bug (the grammar engine's, say)
            _LOG.exception("request %s could not join the batch", request.name)
            raise
        logprobs = None
        if request.params.logprobs is not None and self.first_logprobs is not None:
            logprobs = [self.first_logprobs]
        return seq, TokenEvent([self.first_token_id], logprobs, reason)


@dataclass(eq=False)
class Running:
    """A request in the batch and its engine sequence (block_table: the request's)."""

    request: DecodeRequest
    seq: Sequence
    outlet: Outlet  # where its events go (kept here: its call may end before it leaves)
    order: int  # when it joined (preemption.rank: the last of equal priority goes first)
    # The newest launched step it is in whose ids are not in yet: until that step is done its
    # blocks stay taken (the step writes its KV), even once the request has ended.
    step: Step | None = None
    is_done: bool = False  # ended: its rows in steps still in flight are discarded


@dataclass(eq=False)
class Step:
    """A launched decode step, until its ids are appended."""

    running: list[Running]  # its rows, in order
    started: float  # perf_counter() at launch
    span: Span | None
    sample: PendingSample | None = None  # its ids: set once its sampling is launched
    # Requests that ended while the step was in flight, with the tokens whose KV they hold
    # and their last event (None: the caller is gone): released once the step is done.
    releases: list[tuple[Running, list[int], TokenEvent | BaseException | None]] = field(
        default_factory=list
    )


def start_step_span(outlets: list[Outlet], step: int) -> Span | None:
    """One span per batched step, linked to the `decode request` span of every traced request
    in it (a step serves many requests: none of them is its parent). None when none is traced,
    so with tracing off a step costs one scan of the batch and no span."""
    contexts = [o.span_context for o in outlets if o.span_context is not None]
    if not contexts:
        return None
    attributes = {"mili.decode.step": step, "mili.batch_size": len(outlets)}
    return start_batch_span(_TRACER, "decode step", contexts, attributes)


def matchers(batch: list[Running]) -> list[ConstraintMatcher | None]:
    """Each row's constraint state to mask by (None: unconstrained, or ended: its token is
    discarded)."""
    return [None if r.is_done else r.seq.matcher for r in batch]


def grow(table: RequestTable, batch: list[Running]) -> bool:
    """Cover the position the next step writes for each of `batch`: its newest token's, or,
    for a row in the step in flight (its token not in yet), the one after; False when the pool
    was a block short (the rows before grew)."""
    size = table.block_size
    for r in batch:  # every step, every row: the common case (covered) stays inline
        positions = r.seq.num_tokens + (r.step is not None)
        covered = len(r.request.block_table) * size
        if positions > covered and not table.grow(r.request, positions):
            return False
    return True
