"""One request's generation across decode, prefill and the tokenizer, once its prompt is known.

    1. admit    decode.Generate(prompt ids, sampling, prefill's layout) -> Admitted(prompt blocks)
                (placement.py); RESOURCE_EXHAUSTED or UNAVAILABLE: try the next decode instance
                (nothing was reserved yet, so that is safe); every one full -> wait in the
                admission queue (admitter.py) and try again when room frees, first come first
                served; only a full queue is RESOURCE_EXHAUSTED with RetryInfo
    2. prefill  prefill.Prefill(..., destination={decode address, prompt blocks}), running while
                the decode stream is read: its KV goes straight to decode, the reply carries
                statistics (and the prompt's logprobs when asked for: the first delta waits
                for them), and its failure fails the request at once (decode would
                otherwise wait out its KV lease); prefill full (its queued tokens) -> decode's
                blocks are released and the request waits in the queue again, in its place
    3. stream   decode's token ids -> incremental detokenizer -> stop-string matcher -> out
    4. finish   decode's finish reason, or ours (stop string, stop id, max_tokens), with usage

Prefill or decode down (or draining) before the request's first token, with another of its kind
up: the request starts again there under a fresh id, at most _MAX_RETRIES times; after a token
went out, the error is the answer.

Whatever ends the request (finish, error, the caller cancelling, the deadline), every
downstream call still open is cancelled, so decode and prefill free its blocks at once.

Plain Python over domain types: the services are reached through `calls.Downstream`
(gRPC in clients.py), so this logic runs in tests without sockets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from mili.engine.logprobs import TokenLogprobs
from mili.engine.stop import FinishReason
from mili.errors import PeerUnavailable, ResourceExhausted, Unavailable
from services.frontend.admitter import NoRoom, is_refused_for_room
from services.frontend.calls import (
    Admitted,
    Deadline,
    Downstream,
    InstanceDown,
    PrefillStats,
    Prompt,
    RequestIds,
    TextStream,
    Tokens,
)
from services.frontend.config import FrontendConfig
from services.frontend.placement import Admission, Placement
from services.frontend.router import Route
from services.frontend.stop import StopMatcher, clip_tokens

_LOG = logging.getLogger("mili.frontend")

# Times a request goes to another instance after its prefill or decode turned out down before
# its first token; past them its error is the answer (a flapping instance must not keep a
# request going round). Waits for room do not count.
_MAX_RETRIES = 2


class _Elsewhere(Exception):
    """The request's prefill or decode instance was down before its first token, another of
    its kind is up: the request goes there."""


@dataclass
class Delta:
    """What one GenerateResponse carries; the last one has finish_reason set."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, if asked
    finish_reason: FinishReason | None = None
    # Usage so far, on every delta (the last one's is the request's): the HTTP API's
    # stream_options.continuous_usage_stats shows it on each chunk
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    # Last delta only: the prompt tokens prefill took from its prefix cache (not computed)
    num_cached_tokens: int = 0
    # First delta only, when SamplingParams.prompt_logprobs was set (else None): the prompt's
    # ids (after chat templating) and prompt_logprobs[i - 1] = log p(prompt[i] | prompt[:i]).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # First delta only: the chat prompt ended inside an open think block (Prompt's): the text
    # starts as reasoning (chat_output.py).
    starts_in_reasoning: bool = False


@dataclass(frozen=True)
class Served:
    """Where a finished request ran and what prefill reported: for its log line."""

    route: Route
    last: Delta  # the one with finish_reason and usage
    prefill_stats: PrefillStats | None
    num_cached_blocks: int  # leading prompt blocks decode already held (its prefix cache)
    queued_s: float = 0.0  # in the frontend's admission queue, all its stays together


class Generation:
    def __init__(
        self,
        downstream: Downstream,
        config: FrontendConfig,
        ids: RequestIds,
        prompt: Prompt,
        deadline: Deadline,
        *,
        is_queue_bounded: bool = True,
        priority: int = 0,
    ) -> None:
        """`is_queue_bounded` False: it waits for room past the admission queue's bounds;
        `priority`: its place among waiting requests (lower first)."""
        self._downstream = downstream
        self._config = config
        self._router = downstream.router
        self._ids = ids
        self._prompt = prompt
        self._deadline = deadline
        self._prefill: asyncio.Future[PrefillStats] | None = None
        self._prefill_reply: PrefillStats | None = None
        # Prefill went down after decode's first token, no prompt logprobs asked: its KV had
        # landed, only its statistics are lost; it is no longer watched.
        self._is_prefill_reply_lost = False
        self._output_token_ids: list[int] = []
        self.served: Served | None = None  # once finished
        self._admitter = downstream.admitter
        self._placement = Placement(
            downstream,
            config,
            prompt,
            deadline,
            is_queue_bounded=is_queue_bounded,
            priority=priority,
        )
        self._first_request_id = ids.request_id
        self._num_retries = 0
        self._retried: list[str] = []  # why each earlier try ended, for the request's log line

    @property
    def retried(self) -> tuple[str, ...]:
        """Why each earlier try ended (instance down, no room), oldest first."""
        return tuple(self._retried)

    async def run(self) -> AsyncGenerator[Delta, None]:
        no_room: NoRoom | None = None
        while True:
            admission = await self._placement.admit(self._ids, no_room)
            why: Exception
            async with aclosing(self._generate(admission)) as deltas:
                try:
                    async for delta in deltas:
                        yield delta
                    return
                except NoRoom as refused:  # prefill turned it away: back in line, in its place
                    no_room = why = refused
                except _Elsewhere as down:  # tried again at once (in its place if others wait)
                    no_room, why = None, down
            self._next_try_ids(why)

    def _next_try_ids(self, why: Exception) -> None:
        """A fresh request id for the request's next admission: decode may not have ended the
        one it cancelled yet (a start and a cancel naming one id would collide there), and a
        late event of that one must not reach the next."""
        old = self._ids
        self._retried.append(str(why))
        num_tries = len(self._retried) + 1
        self._ids = RequestIds(f"{self._first_request_id}.{num_tries}", old.client_request_id)
        _LOG.debug(
            "%s (id %s) waits again, as id %s: %s",
            old.client_request_id,
            old.request_id,
            self._ids.request_id,
            why,
        )

    async def _generate(self, admission: Admission) -> AsyncGenerator[Delta, None]:
        """The request on its admission: prefill, decode's stream, clean-up. Raises NoRoom,
        before any delta, when prefill turned the request away for room."""
        text: TextStream | None = None
        is_finished = False
        try:
            self._start_prefill(admission)
            text = self._downstream.detokenize(self._prompt.vocab_size, self._deadline)
            async with aclosing(self._stream(admission, text)) as deltas:
                async for delta in deltas:
                    is_finished = delta.finish_reason is not None
                    yield delta
            if is_finished:  # prefill's reply awaited before the last delta (_stream)
                reply = self._prefill_reply
                self._placement.learn_finished(admission, self._output_token_ids, reply)
                self.served = Served(
                    admission.route,
                    delta,
                    reply,
                    admission.admitted.num_cached_blocks,
                    self._placement.queued_s,
                )
        finally:
            # a no-op when decode already finished
            admission.stream.cancel("" if is_finished else "the request ended before its answer")
            if text is not None:
                text.cancel()
            prefill = self._prefill
            if prefill is not None:
                prefill.cancel()
                if prefill.done() and not prefill.cancelled():
                    prefill.exception()  # retrieved: asyncio would log it as never retrieved
            self._router.finish(admission.ticket)
            self._admitter.notify()  # room on decode: the admission queue's head may fit

    # ---- 2. prefill --------------------------------------------------------------------------

    def _start_prefill(self, admission: Admission) -> None:
        self._prefill_reply = None
        self._is_prefill_reply_lost = False
        address = admission.route.prefill
        admission.prefill_clock = self._router.room_clock(address)
        self._prefill = prefill = self._downstream.prefill(
            admission.route, self._ids, self._prompt, admission.admitted, self._deadline
        )
        prefill.add_done_callback(lambda _: self._prefill_ended(prefill, address))

    def _prefill_ended(self, prefill: asyncio.Future[PrefillStats], address: str) -> None:
        """Prefill's call ended: its prompt left prefill's queue, room for the next, unless
        prefill turned it away (then nothing was there)."""
        if not prefill.cancelled() and is_refused_for_room(prefill.exception()):
            return
        self._router.mark_room(address)
        self._admitter.notify()

    def _check_prefill(self, admission: Admission) -> None:
        """Store prefill's reply once it is in; raise its error if it failed, NoRoom if it
        turned the request away for room before any token (the request waits again)."""
        prefill = self._prefill
        if prefill is None or not prefill.done() or not self._is_prefill_watched:
            return
        try:
            self._prefill_reply = prefill.result()
        except InstanceDown as error:
            self._downstream.request_refresh(down=admission.route.prefill)
            if self._output_token_ids and self._prompt.sampling.prompt_logprobs is None:
                # Decode streams: the KV landed (a hung prefill cut after its commit).
                self._is_prefill_reply_lost = True
                return
            raise self._elsewhere(error, self._pair_without(admission.route.prefill)) from None
        except ResourceExhausted as error:
            if not is_refused_for_room(error) or self._output_token_ids:
                raise
            address = admission.route.prefill
            self._router.mark_full(address, str(error), seen_clock=admission.prefill_clock)
            raise NoRoom(str(error), error.retry_after_s) from None

    @property
    def _is_prefill_watched(self) -> bool:
        """Whether prefill's reply is still to come (or to be read)."""
        return self._prefill_reply is None and not self._is_prefill_reply_lost

    def _elsewhere(self, error: InstanceDown, is_another_up: bool) -> Exception:
        """What to raise for an instance down: `_Elsewhere` before any token (down or draining,
        as in a rolling restart, whose servers refuse new calls until the next poll says so)
        while retries are left and another instance of its kind is up; else `error`."""
        if self._output_token_ids or self._num_retries >= _MAX_RETRIES or not is_another_up:
            return error
        self._num_retries += 1
        return _Elsewhere(str(error))

    def _decode_down(self, error: InstanceDown, admission: Admission) -> Exception:
        self._downstream.request_refresh(down=admission.route.decode)
        return self._elsewhere(error, self._pair_without(admission.route.decode))

    def _pair_without(self, down: str) -> bool:
        """Whether a prefill and a decode instance, neither of them `down`, are up and paired."""
        router = self._router
        prefills = [a for a, v in router.prefills.items() if a != down and v.is_routable]
        decodes = [a for a, v in router.decodes.items() if a != down and v.is_routable]
        return any(router.is_compatible(p, d) for p in prefills for d in decodes)

    async def _with_prompt_logprobs(self, admission: Admission, delta: Delta) -> Delta:
        """The first delta, with the prompt's logprobs from prefill's reply, waited for (it
        normally comes about when decode's first token does); raises prefill's error."""
        while self._prefill_reply is None:
            assert self._prefill is not None
            await asyncio.wait({self._prefill})
            self._check_prefill(admission)
        delta.prompt_token_ids = list(self._prompt.token_ids)
        delta.prompt_logprobs = self._prefill_reply.prompt_logprobs
        return delta

    async def _await_prefill_reply(self) -> None:
        """Decode finished; prefill's reply (statistics only) is normally in already."""
        prefill = self._prefill
        if prefill is not None and not prefill.done():
            await asyncio.wait({prefill}, timeout=self._config.prefill_reply_grace_s)
        if prefill is None or not prefill.done() or prefill.cancelled():
            return
        if prefill.exception() is None:
            self._prefill_reply = prefill.result()

    # ---- 3. stream ---------------------------------------------------------------------------

    async def _next_event(self, admission: Admission) -> Admitted | Tokens:
        """decode's next event, while watching prefill: its failure ends the request now."""
        if self._is_prefill_watched:
            event = await self._read_watching_prefill(admission)
        else:
            # Prefill is done (the usual case past the first token): a plain read, without the
            # task and the wait that watching prefill takes for every event.
            event = await self._read(admission)
        if event is None:
            raise self._ended_early(admission)
        return event

    def _ended_early(self, admission: Admission) -> Unavailable:
        return Unavailable(
            f"decode at {admission.route.decode} ended the stream without a finish reason"
        )

    async def _read(
        self, admission: Admission, read: asyncio.Future[Admitted | Tokens | None] | None = None
    ) -> Admitted | Tokens | None:
        """decode's next event (`read`, when already started); decode being down is noted."""
        try:
            return await (admission.stream.read() if read is None else read)
        except InstanceDown as error:
            raise self._decode_down(error, admission) from None

    async def _read_watching_prefill(self, admission: Admission) -> Admitted | Tokens | None:
        read = asyncio.ensure_future(admission.stream.read())
        try:
            while not read.done() and self._is_prefill_watched:
                assert self._prefill is not None
                watched: set[asyncio.Future[Any]] = {read, self._prefill}
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                try:
                    self._check_prefill(admission)  # raises prefill's error
                except PeerUnavailable:
                    # Prefill's KV destination went away, seen by prefill before this stream
                    # broke: if decode's stream breaks too, decode is the one down, and a
                    # request with no token yet goes elsewhere rather than failing.
                    await asyncio.wait({read}, timeout=self._config.prefill_reply_grace_s)
                    self._raise_if_decode_down(read, admission)
                    raise
            if self._is_prefill_watched and not read.cancelled() and read.exception():
                # Decode failed while prefill was still on: its error may echo prefill's (a
                # transfer prefill broke off when it turned the request away, seen by decode as
                # UNAVAILABLE); prefill's own answer says why, and decode is not down for it.
                assert self._prefill is not None
                await asyncio.wait({self._prefill}, timeout=self._config.prefill_reply_grace_s)
                try:
                    self._check_prefill(admission)
                except InstanceDown:  # prefill itself is down
                    raise
                except Unavailable:
                    self._raise_if_decode_down(read, admission)
                    raise
            return await self._read(admission, read)
        finally:
            if not read.done():
                read.cancel()
            elif not read.cancelled():
                # When prefill's failure wins the race, decode's read may have failed too;
                # retrieve it so asyncio does not log it as an unhandled task error.
                read.exception()

    def _raise_if_decode_down(
        self, read: asyncio.Future[Admitted | Tokens | None], admission: Admission
    ) -> None:
        """Prefill failed for want of its KV destination: when decode's read failed as down,
        decode is the one down (`_decode_down`'s error is raised)."""
        if read.done() and not read.cancelled():
            error = read.exception()
            if isinstance(error, InstanceDown):
                raise self._decode_down(error, admission) from None

    async def _match_stops(
        self, matcher: StopMatcher, text: TextStream, token_ids: list[int], num_generated: int
    ) -> tuple[str, int]:
        """An event's text through the stop strings a token at a time: (the text to send, how
        many of the tokens to keep). Decode merges a lagging stream's tokens into one event, so
        the token that completes a stop string may not be the event's last: the tokens after
        it are cut, as they would be had each token come alone (usage, token_ids and logprobs
        do not depend on the load). Stop strings count from the min_tokens-th token on (vLLM's
        rule): the text of the tokens before it goes out unmatched."""
        out = []
        for i, token_id in enumerate(token_ids):
            may_stop = num_generated + i + 1 >= self._prompt.sampling.min_tokens
            pushed = matcher.push(await text.push([token_id]), may_stop=may_stop)
            out.append(pushed.text)
            if pushed.is_stopped:
                return "".join(out), i + 1
        return "".join(out), len(token_ids)

    async def _stream(self, admission: Admission, text: TextStream) -> AsyncGenerator[Delta, None]:
        sampling = self._prompt.sampling
        stop_token_ids = frozenset(sampling.stop_token_ids)
        matcher = StopMatcher(sampling.stop)
        num_prompt = len(self._prompt.token_ids)
        num_generated = 0
        is_first = sampling.prompt_logprobs is not None  # the first delta still to go out
        starts_in_reasoning = self._prompt.starts_in_reasoning  # told on the first delta
        read = admission.stream.read
        event: Admitted | Tokens | None
        while True:
            if self._is_prefill_watched:
                event = await self._next_event(admission)
            else:
                # Prefill is done (the usual case past the first token): the read inlined, as
                # this runs once per token.
                try:
                    event = await read()
                except InstanceDown as error:
                    raise self._decode_down(error, admission) from None
                if event is None:
                    raise self._ended_early(admission)
            if not isinstance(event, Tokens):
                continue  # a second Admitted would be a decode bug; nothing to show for it
            keep, finish = clip_tokens(
                event.token_ids, stop_token_ids, sampling.max_tokens - num_generated
            )
            token_ids = event.token_ids
            logprobs = event.logprobs
            if keep < len(token_ids):
                token_ids, logprobs = token_ids[:keep], logprobs[:keep]
            # A stop id ends the generation: its id is returned, its text is not (vLLM's rule,
            # as for a stop string; an end-of-sequence token has none anyway).
            num_text = len(token_ids) - (finish is FinishReason.STOP)
            if event.finish_reason is FinishReason.STOP and keep == len(event.token_ids):
                finish = FinishReason.STOP  # decode's stop (a finished constraint) on our last
            finish = finish or event.finish_reason
            if sampling.stop:
                out, kept = await self._match_stops(
                    matcher, text, token_ids[:num_text], num_generated
                )
                if matcher.is_stopped:  # a stop string ended the text: no tokens past it
                    token_ids, logprobs = token_ids[:kept], logprobs[:kept]
            else:
                out = await text.push(token_ids[:num_text])
            num_generated += len(token_ids)
            self._output_token_ids.extend(token_ids)
            if matcher.is_stopped:
                finish = FinishReason.STOP
            elif finish:
                rest = matcher.push(await text.finish())
                out += rest.text if rest.is_stopped else rest.text + matcher.flush()
            if not (finish or token_ids or out):
                continue
            delta = Delta(token_ids, out, logprobs, finish, num_prompt, num_generated)
            if finish:
                await self._await_prefill_reply()  # its cache count is the usage's too
                if self._prefill_reply is not None:
                    delta.num_cached_tokens = self._prefill_reply.num_cached_tokens
            if starts_in_reasoning:
                delta.starts_in_reasoning, starts_in_reasoning = True, False
            if is_first:
                delta, is_first = await self._with_prompt_logprobs(admission, delta), False
            yield delta
            if finish:
                return
