"""One request's telemetry at the frontend, all in one place: its span (`generate {model}`, the
trace's root on our side, current while it runs so every downstream call is its child), its
metrics (time to first token and per output token; how it ended, its end-to-end latency and
lengths: each observed once per request, never per token, so the histograms' cost stays off
the streaming path) and its one log line (INFO: done, failed or cancelled, with the trace's ids
when tracing is on). The servicer tells it what happens.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from mili.cut import cut_short
from mili.plural import plural
from mili.rpc.status import code_of
from mili.telemetry.metrics import FrontendMetrics
from mili.telemetry.tracing import trace_ids
from services.frontend.calls import Prompt, RequestIds
from services.frontend.pipeline import Delta, Served
from services.frontend.validation import ValidRequest

_LOG = logging.getLogger("mili.frontend")
# The global provider's tracer: a no-op until mili.telemetry.tracing installs one.
_TRACER = trace.get_tracer("mili.frontend")


class RequestObserver:
    """What one request did, from the moment the frontend took it (construction)."""

    def __init__(self, metrics: FrontendMetrics, ids: RequestIds) -> None:
        self._metrics = metrics
        self._ids = ids
        self._received_at = time.monotonic()  # time to first token and total count from here
        self._first_at: float | None = None
        self._num_output_tokens = 0  # handed on so far: what a request cut short got
        self._span: Span = trace.INVALID_SPAN

    @contextmanager
    def span(self, model: str, valid: ValidRequest) -> Iterator[None]:
        attributes: dict[str, str | int | float] = {
            "gen_ai.operation.name": "generate",
            "gen_ai.system": "mili",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": valid.sampling.max_tokens,
            "gen_ai.response.id": valid.client_request_id,
            "mili.request_id": self._ids.request_id,
        }
        with _TRACER.start_as_current_span(f"generate {model}", attributes=attributes) as span:
            self._span = span
            yield

    def tokenized(self, prompt: Prompt) -> None:
        """The prompt's length, and the sampling it runs with: known only now (the context
        window may lower a default max_tokens; the model's sampling defaults fill unset fields)."""
        self._metrics.prompt_tokens.inc(len(prompt.token_ids))
        self._metrics.request_prompt_tokens.observe(len(prompt.token_ids))
        self._span.set_attributes(
            {
                "gen_ai.usage.input_tokens": len(prompt.token_ids),
                "gen_ai.request.max_tokens": prompt.sampling.max_tokens,
                "gen_ai.request.temperature": prompt.sampling.temperature,
                "gen_ai.request.top_p": prompt.sampling.top_p,
                "gen_ai.request.top_k": prompt.sampling.top_k,
            }
        )

    def delta(self, delta: Delta) -> None:
        self._num_output_tokens += len(delta.token_ids)
        if self._first_at is None and delta.token_ids:
            self._first_at = time.monotonic()
            ttft_s = self._first_at - self._received_at
            self._metrics.time_to_first_token.observe(ttft_s)
            self._span.set_attribute("gen_ai.server.time_to_first_token", ttft_s)
            self._span.add_event("first token")
        if delta.finish_reason is not None:
            self._span.set_attribute("gen_ai.usage.input_tokens", delta.num_prompt_tokens)
            self._span.set_attribute("gen_ai.usage.output_tokens", delta.num_completion_tokens)
            self._span.set_attribute("gen_ai.response.finish_reasons", [str(delta.finish_reason)])
            num_tokens = delta.num_completion_tokens
            if self._first_at is not None and num_tokens > 1:
                per_token_s = (time.monotonic() - self._first_at) / (num_tokens - 1)
                self._metrics.time_per_output_token.observe(per_token_s)

    def done(self, served: Served, retried: tuple[str, ...] = ()) -> None:
        """`retried`: why each earlier try ended (Generation.retried)."""
        reply, last = served.prefill_stats, served.last
        metrics = self._metrics
        metrics.requests_finished.labels(str(last.finish_reason)).inc()
        metrics.request_duration.observe(time.monotonic() - self._received_at)
        metrics.request_output_tokens.observe(last.num_completion_tokens)
        kv = ""
        if reply is not None:
            rate = reply.kv_bytes / (reply.transfer_ms * 1e6) if reply.transfer_ms > 0 else 0.0
            kv = (
                f"; prefill queue {reply.queue_ms:.1f} ms, compute {reply.compute_ms:.1f} ms, "
                f"KV {reply.kv_bytes} B in {reply.transfer_ms:.1f} ms ({rate:.3f} GB/s); "
                f"prefix cached: {plural(reply.num_cached_tokens, 'token')} on prefill, "
                f"{plural(served.num_cached_blocks, 'block')} on decode"
            )
        first_at = self._first_at
        ttft = "-" if first_at is None else f"{(first_at - self._received_at) * 1e3:.1f} ms"
        queued = f", queued {served.queued_s * 1e3:.1f} ms" if served.queued_s else ""
        self._log(
            "done: prefill %s -> decode %s%s, %s, %s, finish %s, ttft %s%s, total %.1f ms%s",
            served.route.prefill,
            served.route.decode,
            _retried(retried),
            plural(last.num_prompt_tokens, "prompt token"),
            plural(last.num_completion_tokens, "output token"),
            last.finish_reason,
            ttft,
            queued,
            self._elapsed_ms(),
            kv,
        )

    def failed(self, exc: Exception, retried: tuple[str, ...] = ()) -> None:
        """`retried`: why each earlier try ended (Generation.retried)."""
        self._metrics.requests_finished.labels(code_of(exc).name).inc()
        self._log(
            "failed after %.1f ms%s%s: %s: %s",
            self._elapsed_ms(),
            self._output_so_far(),
            _retried(retried),
            code_of(exc).name,
            exc,
        )

    def cancelled(
        self, remaining_s: float | None, cut: str | None = None, retried: tuple[str, ...] = ()
    ) -> None:
        """The handler was cancelled: by the server's own drain (`cut`, its reason: mili.cut),
        else by grpc or aiohttp, where `remaining_s`, grpc's own clock (which fired the end),
        says whether the caller cancelled or its deadline passed. `retried` as for `failed`."""
        if cut is not None:
            code, why = grpc.StatusCode.UNAVAILABLE, cut
        else:
            code = cut_short(remaining_s)
            why = "the caller cancelled"
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                why = "the caller's deadline passed"
        self._metrics.requests_finished.labels(code.name).inc()
        # Nothing escapes the span's block as an Exception here, so it would end unset.
        self._span.set_status(Status(StatusCode.ERROR, f"{code.name}: {why}"))
        self._log(
            "%s after %.1f ms%s%s: %s",
            code.name,
            self._elapsed_ms(),
            self._output_so_far(),
            _retried(retried),
            why,
        )

    def _output_so_far(self) -> str:
        """A request that ended without its last delta: how far it got, on its span (the
        finish sets it otherwise) and as `, N output tokens` in its line ("" for none)."""
        num_tokens = self._num_output_tokens
        self._span.set_attribute("gen_ai.usage.output_tokens", num_tokens)
        return f", {plural(num_tokens, 'output token')}" if num_tokens else ""

    def _log(self, what: str, *args: object) -> None:
        """The request's one log line: its ids, `what`, the trace's ids. The caller's id is
        quoted (repr), as prefill and decode print it: whatever it holds, it cannot pass for
        the line's other fields."""
        ids = self._ids
        _LOG.info(
            f"%r (id %s) {what}%s",
            ids.client_request_id,
            ids.request_id,
            *args,
            trace_ids(self._span),
        )

    def _elapsed_ms(self) -> float:
        return (time.monotonic() - self._received_at) * 1e3


def _retried(whys: tuple[str, ...]) -> str:
    """` (retried N times: why; ...)` for a request that ran elsewhere or waited again before
    the try that served it (those tries are DEBUG lines of their own), each distinct reason
    once with its count; "" for one that ran where it was first sent."""
    if not whys:
        return ""
    counts = Counter(whys)  # first seen first
    reasons = "; ".join(why if n == 1 else f"{n}x {why}" for why, n in counts.items())
    return f" (retried {plural(len(whys), 'time')}: {reasons})"
