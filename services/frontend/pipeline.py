"""One request's generation across decode, prefill and the tokenizer, once its prompt is known.

    1. admit    decode.Generate(prompt ids, sampling, prefill's layout) -> Admitted(block_ids);
                RESOURCE_EXHAUSTED or UNAVAILABLE: try the next decode instance (nothing was
                reserved yet, so that is safe); all full -> RESOURCE_EXHAUSTED with RetryInfo
    2. prefill  prefill.Prefill(..., destination={decode address, block_ids}), running while
                the decode stream is read: its KV goes straight to decode, the reply only
                carries statistics, and its failure fails the request at once (decode would
                otherwise wait out its KV lease)
    3. stream   decode's token ids -> tokenizer DetokenizeStream -> stop-string matcher -> out
    4. finish   decode's finish reason, or ours (stop string, stop id, max_tokens), with usage

Whatever ends the request (finish, error, the caller cancelling, the deadline), every
downstream call still open is cancelled, so decode and prefill free its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from mili.common.v1 import sampling_pb2
from mili.decode.v1 import decode_pb2
from mili.errors import ResourceExhausted, Unavailable
from mili.prefill.v1 import prefill_pb2
from mili.telemetry.tracing import trace_ids
from services.frontend import convert
from services.frontend.backends import Backends
from services.frontend.detokenize import TextStream
from services.frontend.downstream import error_from
from services.frontend.prompt import Deadline, Prompt
from services.frontend.router import Route, Ticket
from services.frontend.stop import StopMatcher

_LOG = logging.getLogger("mili.frontend")

STOP = sampling_pb2.FINISH_REASON_STOP
LENGTH = sampling_pb2.FINISH_REASON_LENGTH


@dataclass
class Delta:
    """What one GenerateResponse carries; the last one has finish_reason and usage set."""

    token_ids: list[int]
    text: str
    logprobs: list[sampling_pb2.Logprobs] = field(default_factory=list)
    finish_reason: int = sampling_pb2.FINISH_REASON_UNSPECIFIED
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0


@dataclass
class _Admission:
    route: Route
    ticket: Ticket
    call: grpc.aio.UnaryStreamCall
    block_ids: list[int]


def clip_tokens(
    token_ids: Sequence[int], stop_token_ids: frozenset[int], room: int
) -> tuple[int, int]:
    """How many of `token_ids` to keep, and the finish reason they cause (0 = none).

    A stop id is kept and ends the generation; so does reaching `room` more tokens. Decode
    applies the same rules; checking them here keeps the caller's contract if it did not.
    """
    for i, token_id in enumerate(token_ids[:room]):
        if token_id in stop_token_ids:
            return i + 1, STOP
    if len(token_ids) >= room:
        return room, LENGTH
    return len(token_ids), 0


class Generation:
    def __init__(
        self,
        backends: Backends,
        request_id: str,
        prompt: Prompt,
        deadline: Deadline,
        *,
        received_at: float | None = None,
    ) -> None:
        self._backends = backends
        self._config = backends.config
        self._router = backends.router
        self._request_id = request_id
        self._prompt = prompt
        self._deadline = deadline
        self._prefill_call: grpc.aio.UnaryUnaryCall | None = None
        self._prefill_task: asyncio.Future[prefill_pb2.PrefillResponse] | None = None
        self._prefill_reply: prefill_pb2.PrefillResponse | None = None
        # time.monotonic() when the frontend received the call: TTFT and total time count from it.
        self._started = time.monotonic() if received_at is None else received_at
        self._first_token_s: float | None = None

    async def run(self) -> AsyncGenerator[Delta, None]:
        admission = await self._admit()
        text: TextStream | None = None
        is_finished = False
        try:
            self._start_prefill(admission)
            facts = await self._backends.tokenizer_facts()
            text = TextStream(
                self._backends.tokenizer,
                f"tokenizer at {self._config.tokenizer_address}",
                facts.vocab_size,
                timeout_s=self._deadline.remaining(),
            )
            async with aclosing(self._stream(admission, text)) as deltas:
                async for delta in deltas:
                    is_finished = bool(delta.finish_reason)
                    yield delta
            if is_finished:
                await self._await_prefill_reply()
                self._log_done(admission, delta)
        finally:
            admission.call.cancel()  # no-op when decode already finished
            if text is not None:
                text.cancel()
            if self._prefill_call is not None:
                self._prefill_call.cancel()
            self._router.finish(admission.ticket)

    # ---- 1. admission ------------------------------------------------------------------------

    async def _admit(self) -> _Admission:
        num_tokens = len(self._prompt.token_ids)
        tried: set[str] = set()
        full: list[ResourceExhausted] = []
        down: list[Exception] = []
        while True:
            try:
                routes = self._router.candidates(exclude=tried)
            except Unavailable:
                if not tried:
                    raise
                routes = []  # every instance went down while we tried them; say why below
            if not routes:
                break
            route = routes[0]
            tried.add(route.decode)
            # Blocks the request holds at its longest: what decode reserves up front, or grows to.
            block_size = self._backends.decode_layouts[route.decode].block_size or 1
            longest = num_tokens + self._prompt.sampling.max_tokens
            ticket = self._router.start(route, num_tokens, -(-longest // block_size))
            call = self._backends.decode(route.decode).Generate(
                decode_pb2.GenerateRequest(
                    request_id=self._request_id,
                    prompt_token_ids=self._prompt.token_ids,
                    sampling=convert.sampling_proto(self._prompt.sampling),
                    prefill_layout=self._backends.prefill_layouts[route.prefill],
                    kv_lease_ms=self._config.kv_lease_ms,
                ),
                timeout=self._deadline.remaining(),
            )
            who = f"decode at {route.decode}"
            try:
                first = await asyncio.wait_for(call.read(), self._config.admit_timeout_s)
            except TimeoutError:
                self._router.finish(ticket, is_refused=True)
                call.cancel()
                self._backends.request_refresh(down=route.decode)
                timeout_s = self._config.admit_timeout_s
                down.append(Unavailable(f"{who} did not admit or refuse within {timeout_s} s"))
                continue
            except grpc.aio.AioRpcError as err:
                self._router.finish(ticket, is_refused=True)
                error = error_from(err, who, is_own_deadline_passed=self._deadline.has_passed)
                if isinstance(error, ResourceExhausted):
                    full.append(error)
                    continue
                if err.code() is grpc.StatusCode.UNAVAILABLE:
                    self._backends.request_refresh(down=route.decode)
                    down.append(error)
                    continue
                raise error from None
            except BaseException:
                self._router.finish(ticket, is_refused=True)
                call.cancel()
                raise
            if first is grpc.aio.EOF or not first.HasField("admitted"):
                self._router.finish(ticket, is_refused=True)
                call.cancel()
                raise Unavailable(f"{who} did not admit the request (no Admitted event first)")
            block_ids = list(first.admitted.block_ids)
            _LOG.debug(
                "%s: %d prompt tokens, prefill %s -> decode %s, blocks %s",
                self._request_id,
                num_tokens,
                route.prefill,
                route.decode,
                block_ids,
            )
            return _Admission(route, ticket, call, block_ids)
        if full:
            retry = [e.retry_after_s for e in full if e.retry_after_s is not None]
            raise ResourceExhausted(
                f"every decode instance is full ({'; '.join(str(e) for e in full)})",
                retry_after_s=min(retry) if retry else self._config.retry_after_s,
            )
        if down:
            raise down[-1]
        raise Unavailable("no decode instance could take the request")

    # ---- 2. prefill --------------------------------------------------------------------------

    def _start_prefill(self, admission: _Admission) -> None:
        call = self._backends.prefill(admission.route.prefill).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=self._request_id,
                token_ids=self._prompt.token_ids,
                sampling=convert.sampling_proto(self._prompt.sampling),
                destination=prefill_pb2.KvDestination(
                    address=admission.route.decode, block_ids=admission.block_ids
                ),
            ),
            timeout=self._deadline.remaining(),
        )
        self._prefill_call = call
        self._prefill_task = asyncio.ensure_future(call)

    def _check_prefill(self, admission: _Admission) -> None:
        """Store prefill's reply once it is in; raise its error, naming it, if it failed."""
        task = self._prefill_task
        if task is None or not task.done() or self._prefill_reply is not None:
            return
        try:
            self._prefill_reply = task.result()
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNAVAILABLE:
                self._backends.request_refresh(down=admission.route.prefill)
            raise error_from(
                err,
                f"prefill at {admission.route.prefill}",
                is_own_deadline_passed=self._deadline.has_passed,
            ) from None

    async def _await_prefill_reply(self) -> None:
        """Decode finished; prefill's reply (statistics only) is normally in already."""
        task = self._prefill_task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=self._config.prefill_reply_grace_s)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            self._prefill_reply = task.result()

    # ---- 3. stream ---------------------------------------------------------------------------

    async def _next_event(self, admission: _Admission) -> decode_pb2.GenerateResponse:
        """decode's next event, while watching prefill: its failure ends the request now."""
        read = asyncio.ensure_future(admission.call.read())
        try:
            while not read.done() and self._prefill_reply is None:
                assert self._prefill_task is not None
                await asyncio.wait({read, self._prefill_task}, return_when=asyncio.FIRST_COMPLETED)
                self._check_prefill(admission)
            event = await read
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.UNAVAILABLE:
                self._backends.request_refresh(down=admission.route.decode)
            raise error_from(
                err,
                f"decode at {admission.route.decode}",
                is_own_deadline_passed=self._deadline.has_passed,
            ) from None
        finally:
            if not read.done():
                read.cancel()
            elif not read.cancelled():
                # When prefill's failure wins the race, decode's read may have failed too;
                # retrieve it so asyncio does not log it as an unhandled task error.
                read.exception()
        if event is grpc.aio.EOF:
            raise Unavailable(
                f"decode at {admission.route.decode} ended the stream without a finish reason"
            )
        result: decode_pb2.GenerateResponse = event
        return result

    async def _stream(self, admission: _Admission, text: TextStream) -> AsyncGenerator[Delta, None]:
        sampling = self._prompt.sampling
        stop_token_ids = frozenset(sampling.stop_token_ids)
        matcher = StopMatcher(sampling.stop)
        num_prompt = len(self._prompt.token_ids)
        num_generated = 0
        while True:
            event = await self._next_event(admission)
            if not event.HasField("tokens"):
                continue  # a second Admitted would be a decode bug; nothing to show for it
            tokens = event.tokens
            keep, finish = clip_tokens(
                tokens.token_ids, stop_token_ids, sampling.max_tokens - num_generated
            )
            token_ids = list(tokens.token_ids[:keep])
            logprobs = list(tokens.logprobs[:keep])
            finish = finish or tokens.finish_reason
            num_generated += len(token_ids)
            if token_ids and self._first_token_s is None:
                self._first_token_s = time.monotonic() - self._started
            pushed = matcher.push(await text.push(token_ids))
            out = pushed.text
            if pushed.is_stopped:
                finish = STOP
            elif finish:
                rest = matcher.push(await text.finish())
                out += rest.text if rest.is_stopped else rest.text + matcher.flush()
            if finish:
                yield Delta(token_ids, out, logprobs, finish, num_prompt, num_generated)
                return
            if token_ids or out:
                yield Delta(token_ids, out, logprobs)

    # ---- 4. log ------------------------------------------------------------------------------

    def _log_done(self, admission: _Admission, last: Delta) -> None:
        """The request's one log line (INFO), with the ids of its trace when tracing is on."""
        reply = self._prefill_reply
        kv = ""
        if reply is not None:
            rate = reply.kv_bytes / (reply.transfer_ms * 1e6) if reply.transfer_ms > 0 else 0.0
            kv = (
                f"; prefill queue {reply.queue_ms:.1f} ms, compute {reply.compute_ms:.1f} ms, "
                f"KV {reply.kv_bytes} B in {reply.transfer_ms:.1f} ms ({rate:.3f} GB/s)"
            )
        ttft = "-" if self._first_token_s is None else f"{self._first_token_s * 1e3:.1f} ms"
        _LOG.info(
            "%s done: prefill %s -> decode %s, %d prompt tokens, %d output tokens, finish %s, "
            "ttft %s, total %.1f ms%s%s",
            self._request_id,
            admission.route.prefill,
            admission.route.decode,
            len(self._prompt.token_ids),
            last.num_completion_tokens,
            finish_reason_name(last.finish_reason),
            ttft,
            (time.monotonic() - self._started) * 1e3,
            kv,
            trace_ids(),
        )


def finish_reason_name(finish_reason: int) -> str:
    """ "stop", "length" (as OpenTelemetry's gen_ai.response.finish_reasons spells them)."""
    name: str = sampling_pb2.FinishReason.Name(finish_reason)
    return name.removeprefix("FINISH_REASON_").lower()
