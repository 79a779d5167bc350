"""A request's deltas for a client that reads slower than they come: one message with everything
pending instead of a queue of one message per token.

    Generation.run ──pull──▶ buffer (at most max_buffered_tokens) ──take all──▶ one Delta ──▶ grpc

A task pulls deltas from the generation while the previous message is being written; each write
that completes takes everything that arrived meanwhile, merged (token ids, text and logprobs
concatenated in order; the finish reason and usage of the last, the prompt logprobs of the
first). A client that keeps up gets one
message per delta, as before; one that lags gets fewer, larger ones, each token exactly once and
in order. Once the buffer holds max_buffered_tokens (`serve-frontend --max-buffered-tokens`) the
task stops pulling, so what waits for the client here is bounded (by that, plus what the delta
that reached it carried beyond it: decode merges a request's tokens into one event while its
stream lags): the generation's own back-pressure (decode's events for the request, at most its
max_tokens ids) takes over from there.

With stream_interval N > 1 (`serve-frontend --stream-interval`), a client that keeps up gets a
message once N token ids are pending, the first one and the last one at once: N times fewer
messages (each costs this process more CPU than anything else it does per token, see
docs/benchmarks.md, "Token path"), for tokens that wait up to N - 1 decode steps.

An error of the generation is raised after the deltas that came before it were taken, as the
status after the messages; closing the merged generator (the client cancelled, its deadline
passed) cancels the task, which closes the generation (its downstream calls are cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from mili.cut import cut_reason
from services.frontend.pipeline import Delta


def merge(deltas: Sequence[Delta]) -> Delta:
    """`deltas` in one: what a client reading them all at once would have read."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    return Delta(
        [t for d in deltas for t in d.token_ids],
        "".join(d.text for d in deltas),
        [lp for d in deltas for lp in d.logprobs],
        last.finish_reason,
        last.num_prompt_tokens,
        last.num_completion_tokens,
        last.num_cached_tokens,
        first.prompt_token_ids,  # the prompt's logprobs ride on the generation's first delta
        first.prompt_logprobs,
        first.starts_in_reasoning,  # so does this
    )


async def coalesced(
    deltas: AsyncGenerator[Delta, None], *, max_buffered_tokens: int, stream_interval: int = 1
) -> AsyncGenerator[Delta, None]:
    """`deltas`, with those that arrive while the consumer is busy merged into one, and (after
    the first) held until `stream_interval` ids are pending or the generation ended."""
    if not 1 <= stream_interval <= max_buffered_tokens:
        raise ValueError("stream_interval must be in [1, max_buffered_tokens]")
    buffer: list[Delta] = []
    num_buffered = 0  # token ids in `buffer` (a delta without any counts as one)
    wake_at = 1  # ids that make a message: 1 for the first, then stream_interval
    error: BaseException | None = None
    is_done = False
    is_closing = False  # the consumer went away: stop pulling, close the generation
    ready = asyncio.Event()  # something to take, or the generation ended
    room = asyncio.Event()  # the buffer is below its bound
    room.set()

    async def pull() -> None:
        nonlocal num_buffered, error, is_done
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    if is_closing:
                        break
                    buffer.append(delta)
                    num_buffered += len(delta.token_ids) or 1
                    if num_buffered >= wake_at:
                        ready.set()
                    if num_buffered >= max_buffered_tokens:
                        room.clear()
                        await room.wait()
                        if is_closing:
                            break
        except BaseException as exc:  # raised to the consumer once it took what came before
            error = exc
        finally:
            is_done = True
            ready.set()

    task = asyncio.create_task(pull())
    cut: str | None = None
    try:
        while True:
            if not is_done and num_buffered < wake_at:
                await ready.wait()
                ready.clear()
                continue
            if buffer:
                taken, buffer = buffer, []
                num_buffered = 0
                wake_at = stream_interval  # the first message went out at once
                room.set()
                yield merge(taken)
            elif is_done:
                if error is not None:
                    raise error
                return
    except asyncio.CancelledError as exc:
        cut = cut_reason(exc)  # a drain's cut goes on to the generation, for its log line
        raise
    finally:
        # Cancelling the task is not enough: an await deep in the generation may swallow the
        # cancellation (asyncio.wait_for in Python 3.11 does when its result comes at the same
        # moment), and the generation would then go on holding decode's blocks. The flag stops
        # the task at its next delta at the latest; leaving the loop closes the generation.
        is_closing = True
        room.set()
        task.cancel(cut)
        with contextlib.suppress(asyncio.CancelledError):
            await task
