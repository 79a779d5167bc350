"""whole_body: a large whole response is built off the event loop, a small one on it."""

from __future__ import annotations

import asyncio
import threading

from mili.engine.logprobs import TokenLogprobs
from services.frontend.http_api.openai_call import MAX_LOOP_LOGPROBS, whole_body
from services.frontend.pipeline import Delta


class WaitsForTheLoop:
    """A Shape whose body can be built only while the event loop keeps running: it waits for a
    callback the loop runs after the build began (a build on the loop would wait forever)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ran = threading.Event()
        self.thread_ids: list[int] = []

    def whole(self, deltas: dict[int, list[Delta]]) -> str:
        self.thread_ids.append(threading.get_ident())
        self.loop.call_soon_threadsafe(self.ran.set)
        if not self.ran.wait(timeout=5):
            raise TimeoutError("the event loop did not run while the body was built")
        return "body"

    def of(self, index: int, delta: Delta) -> list[str]:
        raise NotImplementedError

    def closing(self) -> list[str]:
        raise NotImplementedError


def prompt_delta(num_prompt_tokens: int) -> Delta:
    lps = [TokenLogprobs(-1.0, [(1, -0.5)], 2) for _ in range(num_prompt_tokens - 1)]
    return Delta([5], "x", prompt_token_ids=list(range(num_prompt_tokens)), prompt_logprobs=lps)


def test_a_body_with_a_long_prompts_logprobs_is_built_while_the_loop_runs() -> None:
    """vLLM's prompt_logprobs 20 of a prompt of thousands of tokens is megabytes of JSON: built
    on the loop, /health and every stream of the process waited for it."""

    async def main() -> None:
        shape = WaitsForTheLoop(asyncio.get_running_loop())
        deltas = {0: [prompt_delta(MAX_LOOP_LOGPROBS + 2)]}
        assert await asyncio.wait_for(whole_body(shape, deltas), 10) == "body"
        assert shape.thread_ids != [threading.get_ident()]

    asyncio.run(main())


def test_a_small_body_is_built_on_the_loop() -> None:
    async def main() -> None:
        shape = WaitsForTheLoop(asyncio.get_running_loop())
        shape.ran.set()  # built on the loop, which cannot run the callback meanwhile
        deltas = {0: [prompt_delta(8)], 1: [Delta([5], "x", [TokenLogprobs(-1.0, [])])]}
        assert await whole_body(shape, deltas) == "body"
        assert shape.thread_ids == [threading.get_ident()]

    asyncio.run(main())
