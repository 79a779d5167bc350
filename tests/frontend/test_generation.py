"""The frontend's generation logic on domain types, without sockets: `Generation` driven through
an in-memory `calls.Downstream` (admission across decode instances, the stop rule, stop strings,
prefill failures, cancellation of every downstream call, the router's accounting)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from mili.engine.logprobs import TokenLogprobs
from mili.engine.sampling_params import SamplingParams
from mili.engine.stop import FinishReason
from mili.errors import DataLoss, InvalidArgument, ResourceExhausted, Unavailable
from services.frontend.admission import AdmissionQueue
from services.frontend.admitter import Admitter
from services.frontend.calls import (
    Admitted,
    Deadline,
    InstanceDown,
    PrefillStats,
    Prompt,
    RequestIds,
    Tokenized,
    TokenizerFacts,
    Tokens,
)
from services.frontend.config import FrontendConfig
from services.frontend.pipeline import Delta, Generation
from services.frontend.router import Route, Router
from services.frontend.validation import ValidRequest

PREFILL = "p:1"
IDS = RequestIds("frontend-1", "client-1")
EOS = 0

HANG = "hang"  # a decode event: never answer (until cancelled)
Event = Admitted | Tokens | BaseException | str


class ScriptedDecode:
    """One decode Generate call: returns `events` in order (raising exceptions), then None."""

    def __init__(self, events: list[Event]) -> None:
        self._events = list(events)
        self.is_cancelled = False

    async def read(self) -> Admitted | Tokens | None:
        await asyncio.sleep(0)
        if self.is_cancelled:
            raise Unavailable("cancelled")
        if not self._events:
            return None
        event = self._events.pop(0)
        if event == HANG:
            await asyncio.sleep(3600)
        if isinstance(event, BaseException):
            raise event
        assert isinstance(event, Admitted | Tokens)
        return event

    def cancel(self, why: str) -> None:
        self.is_cancelled = True


class LetterText:
    """Detokenizer: id i is chr(ord('a') + i - 1); EOS has no text."""

    def __init__(self) -> None:
        self.is_cancelled = False

    async def push(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + i - 1) for i in token_ids if i != EOS)

    async def finish(self) -> str:
        return ""

    def cancel(self) -> None:
        self.is_cancelled = True


@dataclass
class FakeDownstream:
    decodes: dict[str, list[Event]]  # address -> the events its Generate call returns
    prefill_outcome: Callable[[], PrefillStats] = lambda: PrefillStats(1.0, 2.0, 3.0, 4096)
    prefill_delay_s: float = 0.0
    router: Router = field(init=False)
    admitter: Admitter = field(init=False)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (kind, address) in call order
    streams: list[ScriptedDecode] = field(default_factory=list)
    prefills: list[asyncio.Future[PrefillStats]] = field(default_factory=list)
    prefill_blocks: list[list[int]] = field(default_factory=list)
    texts: list[LetterText] = field(default_factory=list)
    down: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.router = Router([PREFILL], list(self.decodes))
        self.admitter = Admitter(AdmissionQueue(max_requests=0, max_tokens=0))
        self.router.update_prefill(PREFILL, num_queued_tokens=0, max_prompt_tokens=100)
        for i, address in enumerate(self.decodes):
            # More free blocks first: the router tries decodes in the order given.
            self.router.update_decode(
                address, num_free_blocks=100 - i, num_total_blocks=100, max_context_tokens=64
            )
            self.router.set_pair_error(PREFILL, address, None)

    async def tokenizer_facts(self) -> TokenizerFacts:
        return TokenizerFacts("fake", vocab_size=30, eos_token_ids=(EOS,))

    async def tokenize(self, request: ValidRequest, deadline: Deadline) -> Tokenized:
        raise AssertionError("not used: prompts are given as ids")

    async def refresh(self) -> None:
        pass

    def request_refresh(self, down: str | None = None) -> None:
        self.down.append(down)

    def decode_block_size(self, address: str) -> int:
        return 4

    def generate(
        self, route: Route, ids: RequestIds, prompt: Prompt, deadline: Deadline, priority: int
    ) -> ScriptedDecode:
        assert ids == IDS
        self.calls.append(("decode", route.decode))
        stream = ScriptedDecode(self.decodes[route.decode])
        self.streams.append(stream)
        return stream

    def prefill(
        self,
        route: Route,
        ids: RequestIds,
        prompt: Prompt,
        admitted: Admitted,
        deadline: Deadline,
    ) -> asyncio.Future[PrefillStats]:
        assert ids == IDS and admitted.transfer_token == "token"
        self.calls.append(("prefill", route.prefill))
        self.prefill_blocks.append(admitted.prompt_block_ids)

        async def reply() -> PrefillStats:
            await asyncio.sleep(self.prefill_delay_s)
            return self.prefill_outcome()

        future = asyncio.ensure_future(reply())
        self.prefills.append(future)
        return future

    def detokenize(self, vocab_size: int, deadline: Deadline) -> LetterText:
        text = LetterText()
        self.texts.append(text)
        return text


CONFIG = FrontendConfig(
    tokenizer_address="t:1",
    prefill_addresses=(PREFILL,),
    decode_addresses=("d:1", "d:2"),
    admit_timeout_s=0.5,
    prefill_reply_grace_s=0.5,
)


def tokens(*ids: int, finish: FinishReason | None = None) -> Tokens:
    return Tokens(list(ids), [], finish)


def run(
    downstream: FakeDownstream, sampling: SamplingParams, prompt: tuple[int, ...] = (5, 6, 7)
) -> list[Delta]:
    async def main() -> list[Delta]:
        given = Prompt(prompt, sampling, vocab_size=30)
        generation = Generation(downstream, CONFIG, IDS, given, Deadline(5.0))
        return [delta async for delta in generation.run()]

    return asyncio.run(main())


def in_flight(router: Router) -> int:
    views = [*router.decodes.values(), *router.prefills.values()]
    return sum(v.num_in_flight for v in views)


def test_streams_text_and_clips_at_max_tokens_with_usage() -> None:
    # Decode misbehaves and streams past max_tokens: the frontend's stop rule cuts it.
    down = FakeDownstream({"d:1": [Admitted([3, 4], "token"), tokens(1, 2), tokens(3, 4, 5)]})
    deltas = run(down, SamplingParams(max_tokens=4, stop_token_ids=(EOS,)))
    assert [d.token_ids for d in deltas] == [[1, 2], [3, 4]]
    assert "".join(d.text for d in deltas) == "abcd"
    last = deltas[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.num_prompt_tokens, last.num_completion_tokens) == (3, 4)
    assert down.prefill_blocks == [[3, 4]]  # prefill writes into what decode reserved
    assert down.streams[0].is_cancelled and down.texts[0].is_cancelled
    assert in_flight(down.router) == 0


def test_a_stop_id_is_kept_and_ends_the_generation() -> None:
    down = FakeDownstream({"d:1": [Admitted([1], "token"), tokens(2, EOS, 3)]})
    deltas = run(down, SamplingParams(max_tokens=10, stop_token_ids=(EOS,)))
    assert deltas[-1].token_ids == [2, EOS]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].text == "b"


@pytest.mark.parametrize("merged", [False, True])
def test_a_stop_string_right_before_a_stop_id_cuts_the_id_however_decode_merged(
    merged: bool,
) -> None:
    """ "c" completes the stop string, then decode drew the stop id 4: the id is cut with
    everything after the string, also when it came in the same event (a stop string right
    before EOS under load)."""
    events = [tokens(1, 2, 3, 4)] if merged else [tokens(1), tokens(2), tokens(3), tokens(4)]
    down = FakeDownstream({"d:1": [Admitted([1], "token"), *events]})
    deltas = run(down, SamplingParams(max_tokens=10, stop=("c",), stop_token_ids=(4,)))
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3]
    assert "".join(d.text for d in deltas) == "ab" and deltas[-1].num_completion_tokens == 3


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_a_stop_ids_token_is_returned_without_its_text(stop: tuple[str, ...]) -> None:
    """As vLLM: the id ends the generation and is in token_ids and usage; its text is not
    (also through the stop-string matcher)."""
    down = FakeDownstream({"d:1": [Admitted([1], "token"), tokens(1, 2), tokens(3, 4)]})
    deltas = run(down, SamplingParams(max_tokens=10, stop_token_ids=(3,), stop=stop))
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3]
    assert "".join(d.text for d in deltas) == "ab"
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].num_completion_tokens == 3


def test_a_stop_string_split_across_events_matches_once() -> None:
    down = FakeDownstream(
        {"d:1": [Admitted([1], "token"), tokens(1, 2), tokens(3), tokens(4, 5), tokens(6)]}
    )
    deltas = run(down, SamplingParams(max_tokens=10, stop=("cd",)))
    assert "".join(d.text for d in deltas) == "ab"
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert sum(len(d.token_ids) for d in deltas) == 4  # up to "d", the one completing "cd"


@pytest.mark.parametrize("merged", [False, True])
def test_stop_strings_count_from_the_min_tokens_th_token_however_decode_merged(
    merged: bool,
) -> None:
    """min_tokens 4: "b" (token 2) is not matched, "e" (token 5) is; also when decode merged
    tokens 2..5 into one event (a lagging stream), which then straddles the 4th token."""
    middle = [tokens(2, 3, 4, 5)] if merged else [tokens(2), tokens(3), tokens(4), tokens(5)]
    down = FakeDownstream({"d:1": [Admitted([1], "token"), tokens(1), *middle, tokens(6)]})
    deltas = run(down, SamplingParams(max_tokens=10, min_tokens=4, stop=("b", "e")))
    assert "".join(d.text for d in deltas) == "abcd"
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert sum(len(d.token_ids) for d in deltas) == 5


@pytest.mark.parametrize("merged", [False, True])
def test_a_stop_string_cuts_the_tokens_after_it_however_decode_merged(merged: bool) -> None:
    """Token 3's text is "c": tokens 4 and 5, which decode made before the frontend saw the
    stop, are neither sent nor counted, also when they came in one event with token 3."""
    lp = [TokenLogprobs(-0.1 * i, [(i, -0.1 * i)]) for i in range(1, 6)]
    events = [Tokens([1, 2, 3, 4, 5], lp, None)]
    if not merged:
        events = [Tokens([i], [lp[i - 1]], None) for i in range(1, 6)]
    down = FakeDownstream({"d:1": [Admitted([1], "token"), *events]})
    deltas = run(down, SamplingParams(max_tokens=10, logprobs=1, stop=("c",)))
    assert "".join(d.text for d in deltas) == "ab"
    assert [t for d in deltas for t in d.token_ids] == [1, 2, 3]
    assert [x for d in deltas for x in d.logprobs] == lp[:3]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].num_completion_tokens == 3


def test_logprobs_are_clipped_with_their_tokens() -> None:
    lp = [TokenLogprobs(-0.1 * i, [(i, -0.1 * i)]) for i in range(1, 4)]
    down = FakeDownstream({"d:1": [Admitted([1], "token"), Tokens([1, 2, 3], lp, None)]})
    deltas = run(down, SamplingParams(max_tokens=2, logprobs=1))
    assert deltas[-1].token_ids == [1, 2] and deltas[-1].logprobs == lp[:2]


def test_the_first_delta_waits_for_prefills_prompt_logprobs() -> None:
    prompt_lp = [TokenLogprobs(-1.0, [(6, -0.5)]), TokenLogprobs(-2.0, [(2, -0.1)])]
    down = FakeDownstream(
        {"d:1": [Admitted([1], "token"), tokens(1), tokens(2, finish=FinishReason.LENGTH)]},
        prefill_outcome=lambda: PrefillStats(1.0, 2.0, 3.0, 4096, prompt_logprobs=prompt_lp),
        prefill_delay_s=0.2,  # decode's tokens come first: the first delta still waits
    )
    deltas = run(down, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert [d.token_ids for d in deltas] == [[1], [2]]
    assert deltas[0].prompt_logprobs == prompt_lp and deltas[0].prompt_token_ids == [5, 6, 7]
    assert deltas[1].prompt_logprobs is None and deltas[1].prompt_token_ids is None
    # Not asked: no delta carries any, and nothing waits for prefill's reply.
    down = FakeDownstream({"d:1": [Admitted([1], "token"), tokens(1, finish=FinishReason.LENGTH)]})
    assert run(down, SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_a_prefill_failure_while_the_first_delta_waits_fails_the_request() -> None:
    def fail() -> PrefillStats:
        raise InvalidArgument("sampling.prompt_logprobs", 2, "too long")

    down = FakeDownstream(
        {"d:1": [Admitted([1], "token"), tokens(1), tokens(2, finish=FinishReason.LENGTH)]},
        prefill_outcome=fail,
        prefill_delay_s=0.1,
    )
    with pytest.raises(InvalidArgument):
        run(down, SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert in_flight(down.router) == 0


def test_a_full_decode_is_skipped_for_the_next() -> None:
    full = ResourceExhausted("decode at d:1: full", retry_after_s=0.2)
    down = FakeDownstream(
        {"d:1": [full], "d:2": [Admitted([7], "token"), tokens(1, finish=FinishReason.LENGTH)]}
    )
    deltas = run(down, SamplingParams(max_tokens=5))
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert [c for c in down.calls if c[0] == "decode"] == [("decode", "d:1"), ("decode", "d:2")]
    assert down.prefill_blocks == [[7]]
    assert down.down == []  # full is not down
    assert in_flight(down.router) == 0
    # The refused instance's blocks were taken back from its since-poll estimate.
    assert down.router.decodes["d:1"].num_blocks_since_poll == 0


def test_the_blocks_counted_on_decode_are_what_decode_reserves() -> None:
    # 3 prompt tokens, max_tokens 6, decode's block size 4 (FakeDownstream.decode_block_size):
    # K/V is written at 3 + 6 - 1 = 8 positions, 2 blocks (not ceil(9 / 4) = 3).
    down = FakeDownstream({"d:1": [Admitted([7], "token"), tokens(1, finish=FinishReason.LENGTH)]})
    run(down, SamplingParams(max_tokens=6), prompt=(5, 6, 7))
    assert down.router.decodes["d:1"].num_blocks_since_poll == 2  # until the next Info poll


def test_every_decode_full_is_resource_exhausted_with_the_shortest_retry() -> None:
    down = FakeDownstream(
        {
            "d:1": [ResourceExhausted("d1 full", retry_after_s=0.7)],
            "d:2": [ResourceExhausted("d2 full", retry_after_s=0.3)],
        }
    )
    with pytest.raises(ResourceExhausted) as info:
        run(down, SamplingParams(max_tokens=5))
    assert info.value.retry_after_s == 0.3
    assert "d1 full" in str(info.value) and "d2 full" in str(info.value)
    assert not any(kind == "prefill" for kind, _ in down.calls)  # nothing to prefill into


def test_a_down_decode_is_routed_around_and_reported() -> None:
    down = FakeDownstream(
        {
            "d:1": [InstanceDown("decode at d:1: gone")],
            "d:2": [Admitted([2], "token"), tokens(1, 2)],
        }
    )
    deltas = run(down, SamplingParams(max_tokens=2))
    assert deltas[-1].num_completion_tokens == 2
    assert down.down == ["d:1"]


def test_a_refusal_without_a_retry_hint_is_not_for_room_and_fails_at_once() -> None:
    # RESOURCE_EXHAUSTED without RetryInfo: a limit waiting cannot lift (a message too large).
    too_big = ResourceExhausted("decode at d:1: message larger than max")
    down = FakeDownstream({"d:1": [too_big], "d:2": [Admitted([2], "token")]})
    with pytest.raises(ResourceExhausted, match="larger than max"):
        run(down, SamplingParams(max_tokens=2))
    assert [c for c in down.calls if c[0] == "decode"] == [("decode", "d:1")]
    assert down.router.full_instances() == {}


def test_a_request_no_decode_instance_could_ever_hold_is_refused_not_queued() -> None:
    full = ResourceExhausted("decode at d:1: not enough KV blocks", retry_after_s=0.2)
    down = FakeDownstream({"d:1": [full], "d:2": [full]})
    # Block size 4: 3 prompt tokens + max_tokens 500 need 126 blocks; each instance has 100.
    with pytest.raises(InvalidArgument, match="need 126 KV blocks, more than any decode"):
        run(down, SamplingParams(max_tokens=500))


def test_a_full_decode_is_skipped_until_room_frees_there() -> None:
    full = ResourceExhausted("decode at d:1: full", retry_after_s=0.2)
    finish = tokens(1, finish=FinishReason.LENGTH)
    down = FakeDownstream({"d:1": [full], "d:2": [Admitted([7], "token"), finish]})
    run(down, SamplingParams(max_tokens=5))
    assert down.router.full_instances() == {"d:1": "decode at d:1: full"}
    down.decodes["d:2"] = [Admitted([7], "token"), finish]
    run(down, SamplingParams(max_tokens=5))  # d:1 is not asked: it is known full
    assert [a for kind, a in down.calls if kind == "decode"] == ["d:1", "d:2", "d:2"]
    down.router.update_decode(  # its next Info: room may have freed
        "d:1", num_free_blocks=100, num_total_blocks=100, max_context_tokens=64
    )
    assert down.router.full_instances() == {}


def test_prefill_full_without_a_queue_is_resource_exhausted_and_cancels_decode() -> None:
    def full() -> PrefillStats:
        raise ResourceExhausted("prefill at p:1: queue full", retry_after_s=0.3)

    down = FakeDownstream({"d:1": [Admitted([1], "token"), HANG]}, prefill_outcome=full)
    with pytest.raises(ResourceExhausted, match="prefill at p:1: queue full") as info:
        run(down, SamplingParams(max_tokens=5))  # FakeDownstream's queue holds no one
    assert info.value.retry_after_s == 0.3
    assert down.streams[-1].is_cancelled
    assert down.router.full_instances() == {PREFILL: "prefill at p:1: queue full"}
    assert in_flight(down.router) == 0


def test_decode_failing_because_prefill_turned_the_request_away_is_prefills_answer() -> None:
    # Prefill refused after opening its transfer: decode saw it break off (UNAVAILABLE) before
    # prefill's own answer came. The request is refused for room; decode is not down.
    def full() -> PrefillStats:
        raise ResourceExhausted("prefill at p:1: queue full", retry_after_s=0.3)

    broke_off = InstanceDown("decode at d:1: the KV transfer broke off mid-way")
    down = FakeDownstream(
        {"d:1": [Admitted([1], "token"), broke_off]}, prefill_outcome=full, prefill_delay_s=0.05
    )
    with pytest.raises(ResourceExhausted, match="prefill at p:1: queue full"):
        run(down, SamplingParams(max_tokens=5))
    assert down.down == []
    assert down.router.full_instances() == {PREFILL: "prefill at p:1: queue full"}


def test_decode_failing_while_prefill_runs_on_is_decodes_answer() -> None:
    broke_off = InstanceDown("decode at d:1: gone")
    down = FakeDownstream({"d:1": [Admitted([1], "token"), broke_off]}, prefill_delay_s=3.0)
    began = time.monotonic()
    with pytest.raises(InstanceDown, match="decode at d:1: gone"):
        run(down, SamplingParams(max_tokens=5))
    assert time.monotonic() - began < 1.5  # prefill's grace (0.5 s), not its whole call
    assert down.down == ["d:1"]


def test_other_admission_errors_fail_the_request_without_trying_more() -> None:
    down = FakeDownstream({"d:1": [DataLoss("odd")], "d:2": [Admitted([2], "token")]})
    with pytest.raises(DataLoss):
        run(down, SamplingParams(max_tokens=2))
    assert [c for c in down.calls if c[0] == "decode"] == [("decode", "d:1")]
    assert in_flight(down.router) == 0


def test_a_prefill_failure_fails_the_request_and_cancels_decode() -> None:
    def fail() -> PrefillStats:
        raise InstanceDown("prefill at p:1: gone")

    # Decode never sends tokens: only prefill's failure can end the request.
    down = FakeDownstream({"d:1": [Admitted([1], "token"), HANG]}, prefill_outcome=fail)
    with pytest.raises(InstanceDown, match="prefill at p:1"):
        run(down, SamplingParams(max_tokens=5))
    assert down.streams[-1].is_cancelled
    assert down.down == ["p:1"]
    assert in_flight(down.router) == 0


def test_decode_ending_without_a_finish_reason_is_unavailable() -> None:
    down = FakeDownstream({"d:1": [Admitted([1], "token"), tokens(1)]})
    with pytest.raises(Unavailable, match="without a finish reason"):
        run(down, SamplingParams(max_tokens=5))


class _UnsendableDownstream(FakeDownstream):
    def generate(
        self, route: Route, ids: RequestIds, prompt: Prompt, deadline: Deadline, priority: int
    ) -> ScriptedDecode:
        raise ValueError("Value out of range")  # as a proto field past its type once did


def test_a_call_that_cannot_be_made_leaves_no_request_counted_on_the_instances() -> None:
    """The router counts a request on its instances before decode's call is made; a call that
    fails to start (a request the conversion cannot send) must not keep it counted, or routing
    is skewed and a removed instance is never dropped (it waits for its count to reach 0)."""
    down = _UnsendableDownstream({"d:1": []})
    with pytest.raises(ValueError, match="out of range"):
        run(down, SamplingParams(max_tokens=5))
    assert in_flight(down.router) == 0


def test_a_caller_leaving_mid_stream_cancels_every_downstream_call() -> None:
    down = FakeDownstream({"d:1": [Admitted([1], "token"), tokens(1), HANG]})
    down.prefill_outcome = lambda: PrefillStats(0.0, 0.0, 0.0, 0)

    async def main() -> None:
        generation = Generation(
            down, CONFIG, IDS, Prompt((5,), SamplingParams(max_tokens=9), 30), Deadline(5.0)
        )
        deltas = generation.run()
        first = await anext(deltas)
        assert first.token_ids == [1]
        await deltas.aclose()  # what grpc does when the caller cancels

    asyncio.run(main())
    assert down.streams[0].is_cancelled and down.texts[0].is_cancelled
    assert down.prefills[0].done()
    assert in_flight(down.router) == 0


def test_a_cancel_in_the_same_turn_as_decodes_admission_is_not_lost() -> None:
    """Found by a review: on Python 3.11, asyncio.wait_for returned a result that landed in
    the loop turn the caller's cancel did, and dropped the cancel: a Complete (or HTTP
    non-stream) request ran on to max_tokens for a client that had left."""
    events: list[Event] = [
        Admitted([3, 4], "token"),
        *[tokens(1)] * 8,
        tokens(1, finish=FinishReason.LENGTH),
    ]
    down = FakeDownstream({"d:1": events})

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        scripted = down.generate

        def generate(*args: object) -> ScriptedDecode:
            stream = scripted(*args)  # type: ignore[arg-type]
            read = stream.read

            async def first_read_waits_for_the_gate() -> Admitted | Tokens | None:
                await gate  # then Admitted in this very turn
                stream.read = read  # type: ignore[method-assign]
                first = stream._events.pop(0)
                assert isinstance(first, Admitted)
                return first

            stream.read = first_read_waits_for_the_gate  # type: ignore[method-assign]
            return stream

        down.generate = generate  # type: ignore[method-assign]
        generation = Generation(
            down, CONFIG, IDS, Prompt((5,), SamplingParams(max_tokens=9), 30), Deadline(5.0)
        )

        async def complete() -> list[Delta]:  # what Complete and HTTP non-stream do
            return [delta async for delta in generation.run()]

        task = asyncio.create_task(complete())
        while not down.streams:  # the request waits for decode's admission
            await asyncio.sleep(0.01)

        def admitted_as_the_caller_leaves() -> None:
            gate.set_result(None)
            task.cancel()

        loop.call_soon(admitted_as_the_caller_leaves)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert down.streams[0].is_cancelled
    assert in_flight(down.router) == 0


# ---- prefix affinity -------------------------------------------------------------------------


def test_a_prompt_goes_where_its_prefix_is_and_a_decode_that_lost_it_is_forgotten() -> None:
    """Found by a read-only review: one prefix reported missing once made the index forget all
    an instance held (and a prefill asked for prompt logprobs reports none cached, always)."""
    prompt = tuple(i % 29 + 1 for i in range(40))  # 2 keys of 16 tokens in the router's index
    other = tuple(29 - i % 29 for i in range(40))
    finish = tokens(1, 2, finish=FinishReason.LENGTH)
    down = FakeDownstream({"d:1": [], "d:2": [Admitted([1], "token"), finish]})
    router, index = down.router, down.router.prefix_index
    params = SamplingParams(max_tokens=2)
    down.prefill_outcome = lambda: PrefillStats(1.0, 2.0, 3.0, 4096, num_cached_tokens=32)

    def load(d1_free: int, d2_free: int) -> None:
        for address, free in (("d:1", d1_free), ("d:2", d2_free)):
            router.update_decode(
                address, num_free_blocks=free, num_total_blocks=100, max_context_tokens=64
            )

    def held(p: tuple[int, ...]) -> dict[str, int]:
        return index.matches(index.keys(p), now=time.monotonic())

    def last_decode() -> str:
        return [a for kind, a in down.calls if kind == "decode"][-1]

    def d1_admits(num_cached_blocks: int) -> None:
        down.decodes["d:1"] = [Admitted(list(range(10)), "token", num_cached_blocks), finish]

    d1_admits(0)
    run(down, params, prompt)
    load(100, 99)
    run(down, params, other)
    assert last_decode() == "d:1" and held(other) == {"d:1": 2, PREFILL: 2}
    load(50, 100)  # d:2 looks emptier, yet the prompt goes where its prefix is
    d1_admits(8)  # and d:1 says it holds it (8 blocks of 4)
    run(down, params, prompt)
    assert last_decode() == "d:1" and held(other) == {"d:1": 2, PREFILL: 2}
    load(50, 100)
    d1_admits(0)  # d:1 evicted this prefix: only it is forgotten, not what else d:1 holds
    run(down, params, prompt)
    assert last_decode() == "d:1"
    assert held(other) == {"d:1": 2, PREFILL: 2} and held(prompt)["d:1"] == 2  # re-learned
    # Prompt logprobs make prefill compute the whole prompt: its "none cached" says nothing.
    down.prefill_outcome = lambda: PrefillStats(1.0, 2.0, 3.0, 4096, prompt_logprobs=[])
    run(down, SamplingParams(max_tokens=2, prompt_logprobs=0), prompt)
    assert held(prompt)[PREFILL] == 2
    router.mark_down("d:1")  # a restart empties its cache: everything it held is forgotten
    assert held(other) == {PREFILL: 2} and "d:1" not in held(prompt)
    load(100, 100)
    run(down, params, other)  # no affinity left for `other`: load order (d:1 chosen last)
    assert last_decode() == "d:2"


def test_an_instance_that_caches_no_prefix_draws_no_request_for_one() -> None:
    """A decode whose Info says its prefix cache is off (--no-prefix-cache) is never credited
    with a prompt it served: the next request with that prefix goes where the load says, not
    back to an instance that will never hold it (found by a read-only review: its keys were
    recorded again after every admission)."""
    prompt = tuple(i % 29 + 1 for i in range(40))
    finish = tokens(1, 2, finish=FinishReason.LENGTH)
    admitted = Admitted(list(range(10)), "token", 0)
    down = FakeDownstream({"d:1": [admitted, finish], "d:2": [admitted, finish]})
    router, index = down.router, down.router.prefix_index
    params = SamplingParams(max_tokens=2)

    def load(d1_free: int, d2_free: int, *, d1_caches: bool) -> None:
        for address, free in (("d:1", d1_free), ("d:2", d2_free)):
            router.update_decode(
                address,
                num_free_blocks=free,
                num_total_blocks=100,
                max_context_tokens=64,
                caches_prefixes=d1_caches or address != "d:1",
            )

    def last_decode() -> str:
        return [a for kind, a in down.calls if kind == "decode"][-1]

    load(100, 99, d1_caches=False)
    run(down, params, prompt)
    assert last_decode() == "d:1"
    assert index.matches(index.keys(prompt), now=time.monotonic()) == {PREFILL: 2}
    load(50, 100, d1_caches=False)  # d:2 emptier: with no prefix on d:1, the load decides
    run(down, params, prompt)
    assert last_decode() == "d:2"
    load(100, 50, d1_caches=True)  # d:1 restarted with its cache on: credited again
    router.mark_down("d:2")
    run(down, params, prompt)
    assert last_decode() == "d:1"
    assert index.matches(index.keys(prompt), now=time.monotonic())["d:1"] == 2


def test_a_tokenizer_restarting_after_the_prompt_was_made_fails_no_request() -> None:
    """Found by a read-only review: once admitted, a request asked the tokenizer's facts again
    (for detokenization), so a tokenizer restarting meanwhile (its facts unknown until its next
    Info) failed requests already tokenized and admitted. Their prompt carries what it needs."""
    down = FakeDownstream(
        {"d:1": [Admitted([1], "token"), tokens(1, 2, finish=FinishReason.LENGTH)]}
    )
    down.prefill_outcome = lambda: PrefillStats(0.0, 0.0, 0.0, 0)

    async def restarting() -> TokenizerFacts:
        raise Unavailable("tokenizer at t:1: failed to connect")

    down.tokenizer_facts = restarting  # type: ignore[method-assign]
    deltas = run(down, SamplingParams(max_tokens=2))
    assert [t for d in deltas for t in d.token_ids] == [1, 2]
    assert deltas[-1].finish_reason is FinishReason.LENGTH
