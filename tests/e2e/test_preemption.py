"""Requests without max_tokens on a decode pool they outgrow together, through `mili serve`
(demo model) and the openai SDK's chat completions, as an agent library sends them: each may
use what the pool leaves after its prompt (the context is larger), so decode reserves only
their first outputs, grows them as they run, preempts the one that joined last when the pool
runs dry and resumes it once blocks free. Every one finishes whole; decode's metrics count the
preemptions, every block comes back, each request says (greedy) what it says alone, and each
preemption is a span of the request's trace."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from tests.otlp_receiver import Receiver, serving
from tests.service_process import ServiceProcess

NUM_BLOCKS = 64  # of 16 tokens: 1024 positions, a quarter of the demo model's context


def _sample(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in the metrics"
    return float(match.group(1))


@pytest.fixture
def collector() -> Iterator[tuple[Receiver, int]]:
    with serving() as served:
        yield served


def test_requests_without_max_tokens_outgrow_the_pool_and_all_finish(
    demo_model_dir: Path, collector: tuple[Receiver, int]
) -> None:
    receiver, port = collector
    serve = ServiceProcess(
        "serve", "--model", str(demo_model_dir), "--port", "0", "--metrics-port", "0",
        "--http-port", "0", "--decode-args", f"--num-blocks {NUM_BLOCKS}",
        "--otlp-endpoint", f"http://127.0.0.1:{port}",
        timeout_s=180,
    )  # fmt: skip
    try:
        summary = "".join(serve.stdout_lines)
        decode_metrics = dict(re.findall(r"mili serve: (\S+)\s.*metrics (\S+)", summary))[
            "decode-0"
        ]
        client = OpenAI(base_url=f"{serve.http_url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        prompt_tokens: set[int] = set()

        def chat(topic: str) -> tuple[int, str | None, str]:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Tell me a long story about {topic}"}],
                temperature=0,
                extra_body={"ignore_eos": True},
                timeout=240,
            )
            assert reply.usage is not None
            prompt_tokens.add(reply.usage.prompt_tokens)
            room = NUM_BLOCKS * 16 - reply.usage.prompt_tokens + 1  # prompt + max_tokens - 1
            message = reply.choices[0].message
            text = f"{getattr(message, 'reasoning_content', None)}|{message.content}"
            return reply.usage.completion_tokens - room, reply.choices[0].finish_reason, text

        started = time.monotonic()
        # Each is admitted with the blocks of its prompt and first 256 outputs, and needs all
        # 64 at its longest: the three fill the pool at once and outgrow it together.
        topics = ["ships", "trains", "kites"]
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(chat, topics))
        took = f"after {time.monotonic() - started:.0f} s"
        assert [r[:2] for r in results] == [(0, "length")] * 3, took
        preemptions = _sample(decode_metrics, "mili_decode_preemptions_total")
        assert preemptions >= 2
        # Greedy: each alone (never preempted) says what it said when preempted and resumed.
        assert [chat(topic) for topic in topics] == results
        assert _sample(decode_metrics, "mili_decode_preemptions_total") == preemptions
        assert _sample(decode_metrics, "mili_decode_kv_blocks_free") == NUM_BLOCKS
        assert _sample(decode_metrics, "mili_decode_preempted_requests") == 0
    finally:
        assert serve.terminate(timeout_s=90) == 0  # SIGTERM: every child drains, then flushes
    # Each preemption is a `decode preempted` span beneath its request's `decode request`.
    spans = [s for service, s in receiver.snapshot() if service == "mili-decode"]
    requests = {s.span_id for s in spans if s.name == "decode request"}
    waits = [s for s in spans if s.name == "decode preempted"]
    assert len(waits) == preemptions and all(s.parent_span_id in requests for s in waits)
    for wait in waits:
        attributes = {a.key: a.value.int_value for a in wait.attributes}
        assert attributes["mili.decode.output_tokens"] > 0
        assert attributes["mili.decode.blocks_back"] > 0
        # it wrote prompt + outputs - 1 tokens' K/V: all of them back, computed or cached
        written = (
            attributes["mili.decode.recomputed_tokens"] + attributes["mili.decode.cached_tokens"]
        )
        assert written - attributes["mili.decode.output_tokens"] + 1 in prompt_tokens
