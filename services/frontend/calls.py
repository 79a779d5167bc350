"""What the frontend's generation logic needs from the services behind it, as plain types.

`Generation` (pipeline.py) and `tokenize` (prompt.py) talk to tokenizer, prefill and decode only
through the `Downstream` protocol below, in domain types: no protobuf, no sockets. The gRPC
implementation is `clients.GrpcDownstream` (with conversions in convert.py); tests can drive the
logic with an in-memory one.

Every method raises domain errors (mili.errors) naming the instance that failed; `InstanceDown`
(an Unavailable) means the instance did not answer at all, so the caller should route around it.
A downstream DEADLINE_EXCEEDED is DeadlineExceeded only once the caller's own `Deadline` passed;
before that it means a peer is stuck (Unavailable).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from mili.engine.logprobs import TokenLogprobs
from mili.engine.sampling_params import SamplingParams
from mili.engine.stop import FinishReason
from mili.errors import Unavailable
from services.frontend.router import Route, Router
from services.frontend.validation import ValidRequest

if TYPE_CHECKING:
    from services.frontend.admitter import Admitter  # it imports Deadline from here


class InstanceDown(Unavailable):
    """The instance answered UNAVAILABLE or not at all (down, draining, unreachable): retry on
    another, and re-poll it before routing to it again."""


# The longest timeout a downstream call is handed: grpc turns one past what its clock can add
# (billions of seconds, a `grpc-timeout` of 2562047H) into a deadline already expired, and
# StreamedGenerate.timeout_ms is a uint32 of milliseconds (whole seconds keep its ceil in range).
MAX_DOWNSTREAM_TIMEOUT_S = (2**32 - 1) // 1000  # about 49.7 days


class Deadline:
    """The caller's deadline, handed to every downstream call as its timeout (one further off
    than MAX_DOWNSTREAM_TIMEOUT_S is kept here in full, and handed on as that)."""

    def __init__(self, time_remaining_s: float | None) -> None:
        self._at = None if time_remaining_s is None else time.monotonic() + time_remaining_s

    def remaining(self) -> float | None:
        """Seconds left, at most MAX_DOWNSTREAM_TIMEOUT_S (never 0: grpc treats a timeout of 0
        as already expired, as it is)."""
        if self._at is None:
            return None
        return min(MAX_DOWNSTREAM_TIMEOUT_S, max(0.001, self._at - time.monotonic()))

    @property
    def has_passed(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at


@dataclass(frozen=True)
class TokenizerFacts:
    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_input_chars: int = 0  # the longest text (or messages' content) it tokenizes; 0: unknown
    # SHA-256 of the tokenizer file it hands out, loaded to detokenize here.
    tokenizer_file_sha256: str = ""
    # The model's sampling defaults (generation_config.json): (field, value) pairs.
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()


@dataclass(frozen=True)
class RequestIds:
    """A request's two ids. Prefill and decode key on `request_id`, minted by this frontend and
    unique per process start; the caller's own id is only a label (two callers may both send
    "1"), echoed back and logged."""

    request_id: str
    client_request_id: str


@dataclass(frozen=True)
class Tokenized:
    token_ids: tuple[int, ...]
    # The chat prompt ends inside a think block its template opened (reasoning.opens_reasoning)
    starts_in_reasoning: bool = False


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    sampling: SamplingParams  # max_tokens fitted to the context, EOS ids among the stop ids
    # The tokenizer's ids, as it said when the prompt was made: what detokenization takes (a
    # tokenizer restarting later, its facts unknown a while, must not fail the request)
    vocab_size: int
    starts_in_reasoning: bool = False  # Tokenized's


@dataclass(frozen=True)
class Admitted:
    """Decode reserved the request's KV blocks; prefill writes the prompt's into these, and its
    transfer must carry `transfer_token` (decode refuses it otherwise)."""

    prompt_block_ids: list[int]
    transfer_token: str
    num_cached_blocks: int = 0  # leading prompt blocks decode already holds: not sent


@dataclass(frozen=True)
class Tokens:
    """Tokens decode generated since its previous event."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]  # one per token id when asked for, else empty
    finish_reason: FinishReason | None = None  # set on decode's last event


@dataclass(frozen=True)
class PrefillStats:
    """Prefill's reply: timings and bytes (its first token reaches us through decode), and the
    prompt's logprobs when they were asked for."""

    queue_ms: float
    compute_ms: float
    transfer_ms: float
    kv_bytes: int
    num_cached_tokens: int = 0  # prompt tokens prefill took from its prefix cache
    # SamplingParams.prompt_logprobs set: entry i - 1 for prompt token i (len(prompt) - 1).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class DecodeStream(Protocol):
    """One request's Generate call on a decode instance."""

    async def read(self) -> Admitted | Tokens | None:
        """The next event; None when decode ended the stream. Raises decode's error."""
        ...

    def cancel(self, why: str) -> None:
        """End the call (decode frees the request's blocks); a no-op once it ended. `why`
        says so in its span: "" when the frontend has the whole answer (a stop string)."""
        ...


class TextStream(Protocol):
    """One request's incremental detokenization."""

    async def push(self, token_ids: list[int]) -> str:
        """The text these ids complete ("" while a character is still incomplete)."""
        ...

    async def finish(self) -> str:
        """Everything still held back; closes the stream."""
        ...

    def cancel(self) -> None: ...


class Downstream(Protocol):
    @property
    def router(self) -> Router: ...

    @property
    def admitter(self) -> Admitter:
        """The admission queue every request of this frontend waits in for room."""
        ...

    async def tokenizer_facts(self) -> TokenizerFacts:
        """The tokenizer's vocabulary size and EOS ids (cached); raises Unavailable."""
        ...

    async def tokenize(self, request: ValidRequest, deadline: Deadline) -> Tokenized:
        """The prompt of `request` (text, or messages through the chat template) as token ids."""
        ...

    async def refresh(self) -> None:
        """Poll every instance's Info now."""
        ...

    def request_refresh(self, down: str | None = None) -> None:
        """An instance failed a request: route around it now and re-poll soon."""
        ...

    def decode_block_size(self, address: str) -> int:
        """Tokens per KV block of a decode instance (from its polled layout)."""
        ...

    def generate(
        self, route: Route, ids: RequestIds, prompt: Prompt, deadline: Deadline, priority: int
    ) -> DecodeStream:
        """Open decode's Generate for `route` (with route.prefill's KV layout to check);
        `priority`: the request's (decode preempts by it)."""
        ...

    def prefill(
        self,
        route: Route,
        ids: RequestIds,
        prompt: Prompt,
        admitted: Admitted,
        deadline: Deadline,
    ) -> asyncio.Future[PrefillStats]:
        """Start prefill's call that sends the prompt's KV into the blocks decode `admitted`;
        cancelling the future cancels the call."""
        ...

    def detokenize(self, vocab_size: int, deadline: Deadline) -> TextStream:
        """One request's text, detokenized with the tokenizer file of the facts last fetched."""
        ...
