"""Every generation this frontend runs, whichever API it came through (gRPC servicer, HTTP).

One place for what a request goes through between its validated input and its deltas: the
concurrency limit, the request ids prefill and decode key on, the telemetry (RequestObserver:
span, latencies, the one log line), its status by the caller's request id (request_status.py,
for GET /status), tokenization and the Generation across the services. The APIs differ only in
how they parse requests and shape replies.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing

from mili.cut import cut_reason
from mili.engine.constraint.spec import Constraint
from mili.errors import InvalidArgument, ResourceExhausted
from mili.plural import plural
from mili.telemetry.metrics import FrontendMetrics
from services.frontend.backends import Backends
from services.frontend.calls import Deadline, RequestIds
from services.frontend.clients import GrpcDownstream
from services.frontend.observer import RequestObserver
from services.frontend.pipeline import Delta, Generation
from services.frontend.prompt import check_input_chars, check_token_ids, tokenize
from services.frontend.request_status import RequestStatuses
from services.frontend.tool_grammar import bad_tool
from services.frontend.validation import RequestInput, ValidRequest, validate


class Generations:
    def __init__(self, backends: Backends, metrics: FrontendMetrics) -> None:
        self.backends = backends
        self.metrics = metrics
        self.config = backends.config
        self._downstream = GrpcDownstream(backends)
        self._num_running = 0
        metrics.watch(num_in_flight_requests=lambda: self._num_running)
        # Request ids for prefill and decode: this process's random prefix and a counter, so
        # they never collide with another caller's, another frontend's or a restart's.
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count(1)
        # Every request's progress by the caller's id, whichever API it came through.
        self.statuses = RequestStatuses(self.config.status_history)

    @property
    def model(self) -> str:
        return self.backends.model

    def validate(self, request: RequestInput) -> ValidRequest:
        """The request checked against the limits and the context window; InvalidArgument
        naming each bad field."""
        return validate(request, self.config.limits)

    async def tokenize(self, valid: ValidRequest) -> tuple[int, ...]:
        """The prompt of `valid` as token ids (messages through the chat template), checked as
        a generation's is (vocabulary, the tokenizer's character limit), without running it."""
        facts = await self._downstream.tokenizer_facts()
        check_token_ids(valid, facts.vocab_size)
        check_input_chars(valid, facts.max_input_chars)
        if valid.prompt_field == "token_ids":
            return valid.token_ids
        return (await self._downstream.tokenize(valid, Deadline(None))).token_ids

    async def run(self, valid: ValidRequest, deadline: Deadline) -> AsyncGenerator[Delta, None]:
        """The request's deltas, the last one with its finish reason and usage. Closing the
        generator early (the caller went away) cancels every downstream call."""
        self._num_running += 1  # this one included; refused below (logged) past the limit
        ids = RequestIds(f"{self._id_prefix}-{next(self._id_counter)}", valid.client_request_id)
        tracked = self.statuses.start(valid.client_request_id, valid.sampling.max_tokens)
        finish_reason: str | None = None  # as the last delta says; else how it ended
        # Metrics, span and the request's one log line: the observer is told what happens.
        observer = RequestObserver(self.metrics, ids)
        generation: Generation | None = None
        with observer.span(self.backends.model, valid):
            try:
                if self._num_running > self.config.max_concurrent_requests:
                    raise ResourceExhausted(
                        "the frontend is running its limit of "
                        f"{plural(self.config.max_concurrent_requests, 'request')}",
                        retry_after_s=self.config.retry_after_s,
                    )
                prompt = await tokenize(self._downstream, self.config, valid, deadline)
                observer.tokenized(prompt)
                # Refused before any KV is reserved; compiled as prefill and decode will, behind
                # its think block (known once the prompt is rendered).
                if prompt.sampling.constraint is not None:
                    await self._compile(valid, prompt.sampling.constraint)
                tracked.max_tokens = prompt.sampling.max_tokens  # fitted to the context
                generation = Generation(
                    self._downstream,
                    self.config,
                    ids,
                    prompt,
                    deadline,
                    is_queue_bounded=not valid.is_later_choice,
                    priority=valid.priority,
                )
                async with aclosing(generation.run()) as deltas:
                    async for delta in deltas:
                        tracked.num_generated += len(delta.token_ids)
                        if delta.finish_reason is not None:
                            finish_reason = delta.finish_reason.value
                        observer.delta(delta)
                        yield delta
                if generation.served is not None:
                    observer.done(generation.served, generation.retried)
            except Exception as exc:
                observer.failed(exc, () if generation is None else generation.retried)
                finish_reason = finish_reason or "error"
                raise
            except (asyncio.CancelledError, GeneratorExit) as exc:
                # The caller cancelled, went away or its deadline passed, or a drain cut the
                # call (every downstream call is cancelled on the way out).
                retried = () if generation is None else generation.retried
                observer.cancelled(deadline.remaining(), cut_reason(exc), retried)
                finish_reason = finish_reason or "cancelled"
                raise
            finally:
                self._num_running -= 1
                self.statuses.end(tracked, finish_reason or "error")

    async def _compile(self, valid: ValidRequest, constraint: Constraint) -> None:
        """Compile `valid`'s constraint: InvalidArgument or ResourceExhausted naming its field;
        for the constraint of an enforced tool choice, the tool whose parameters do not
        compile."""
        try:
            await self.backends.tokenizer.compile_constraint(constraint)
        except (InvalidArgument, ResourceExhausted):
            if not valid.tool_choice.is_forced:
                raise
            bad = await asyncio.to_thread(bad_tool, valid.tools, valid.tool_choice)
            if bad is None:
                raise
            raise bad from None
