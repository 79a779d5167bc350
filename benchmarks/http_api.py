"""The HTTP API against the gRPC API on one frontend: frontend CPU per streamed token, and the
time to first token each adds at concurrency 1 (issue 30's targets: HTTP <= 1.3x gRPC's CPU per
token, <= 1 ms more TTFT).

One deployment (token_path.py's: the real tokenizer, prefill, decode and frontend services on a
model built to make tokens fast on a CPU, so the load is on the path from decode to the client)
with `--http-port 0`. Both clients run in this process, asyncio, written alike:

    grpc   GenerationService.Generate (token-id prompt, ignore_eos, greedy), one stream each
    http   POST /v1/completions, the same request as JSON with "stream": true and
           stream_options.include_usage, read as server-sent events (aiohttp)

Per round and concurrency, the two APIs run one after the other (order flipped every round) and
the frontend's CPU (user + system from /proc) over each phase is divided by the tokens streamed.
TTFT: --ttft-requests sequential requests, alternating the APIs request by request, from
sending to the first event carrying a token; medians per API and their difference.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/http_api.py --concurrency 1 \\
        --concurrency 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.token_path import Deployment, build_model  # noqa: E402
from mili.pb.common.v1 import sampling_pb2  # noqa: E402
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402

Client = Callable[[list[int]], Awaitable[tuple[int, float]]]  # -> (tokens, ttft_s)
# Messages (gRPC responses, SSE events with text) per API: a client that reads slower than
# tokens come gets several tokens per message (the coalescer), which costs the frontend less.
MESSAGES: dict[str, int] = {"grpc": 0, "http": 0}


def grpc_client(address: str, output_tokens: int) -> tuple[Client, grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(address)
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    sampling = sampling_pb2.SamplingParams(
        max_tokens=output_tokens, temperature=0.0, ignore_eos=True
    )

    async def run(prompt: list[int]) -> tuple[int, float]:
        started = time.perf_counter()
        ttft = 0.0
        num_tokens = 0
        request = generation_pb2.GenerateRequest(token_ids=prompt, sampling=sampling)
        async for response in stub.Generate(request):
            if response.token_ids and not num_tokens:
                ttft = time.perf_counter() - started
            num_tokens += len(response.token_ids)
            MESSAGES["grpc"] += 1
        return num_tokens, ttft

    return run, channel


def http_client(url: str, model: str, output_tokens: int, session: aiohttp.ClientSession) -> Client:
    async def run(prompt: list[int]) -> tuple[int, float]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        ttft = 0.0
        num_tokens = 0
        async with session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["choices"]:
                    MESSAGES["http"] += 1
                if not ttft and event["choices"] and event["choices"][0]["text"]:
                    ttft = time.perf_counter() - started
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
        return num_tokens, ttft

    return run


async def load(client: Client, prompts: list[list[int]], concurrency: int) -> int:
    """Every prompt through `client`, `concurrency` at a time; the tokens streamed."""
    queue = list(prompts)
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            tokens, _ = await client(queue.pop())
            total += tokens

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total


async def bench(args: argparse.Namespace, d: Deployment) -> dict[str, Any]:
    frontend = d.services["frontend"]
    assert frontend.http_url is not None
    rpc, channel = grpc_client(frontend.address, args.output_tokens)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"{frontend.http_url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        clients = {
            "grpc": rpc,
            "http": http_client(frontend.http_url, model, args.output_tokens, session),
        }
        prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_tokens)]
        for client in clients.values():  # warm-up: connections, the frontend's first polls
            await load(client, [prompt] * 8, 8)
        cpu: dict[tuple[str, int], float] = {}
        tokens: dict[tuple[str, int], int] = {}
        rates: dict[tuple[str, int], list[float]] = {}
        messages: dict[tuple[str, int], int] = {}
        for r in range(args.rounds):
            names = ["grpc", "http"] if r % 2 == 0 else ["http", "grpc"]
            for c in args.concurrency:
                for name in names:
                    n = max(c * args.requests_per_client, 1)
                    before, started = frontend.cpu_s(), time.perf_counter()
                    sent = MESSAGES[name]
                    num = await load(clients[name], [prompt] * n, c)
                    messages[(name, c)] = messages.get((name, c), 0) + MESSAGES[name] - sent
                    wall = time.perf_counter() - started
                    key = (name, c)
                    cpu[key] = cpu.get(key, 0.0) + frontend.cpu_s() - before
                    tokens[key] = tokens.get(key, 0) + num
                    rates.setdefault(key, []).append(num / wall)
                    print(f"round {r} {name} c={c}: {num / wall:.0f} tok/s", flush=True)
        ttft: dict[str, list[float]] = {"grpc": [], "http": []}
        for i in range(args.ttft_requests):
            for name in ("grpc", "http") if i % 2 == 0 else ("http", "grpc"):
                _, first = await clients[name](prompt)
                ttft[name].append(first)
    await channel.close()
    rows = []
    print(
        "| API | concurrency | streamed tok/s | tokens per message | frontend CPU ms/token |"
        " vs gRPC | frontend CPU us/message |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        grpc_ms = 1e3 * cpu[("grpc", c)] / tokens[("grpc", c)]
        for name in ("grpc", "http"):
            ms = 1e3 * cpu[(name, c)] / tokens[(name, c)]
            rate = statistics.median(rates[(name, c)])
            per_message = tokens[(name, c)] / max(1, messages[(name, c)])
            rows.append(
                {
                    "api": name,
                    "concurrency": c,
                    "tokens_per_s": rate,
                    "tokens_per_message": per_message,
                    "cpu_ms": ms,
                }
            )
            print(
                f"| {name} | {c} | {rate:.0f} | {per_message:.2f} | {ms:.3f} "
                f"| {ms / grpc_ms:.2f}x | {1e3 * ms * per_message:.1f} |"
            )
    medians = {name: 1e3 * statistics.median(values) for name, values in ttft.items()}
    print(
        f"TTFT at concurrency 1 ({args.ttft_requests} each): grpc p50 {medians['grpc']:.2f} ms, "
        f"http p50 {medians['http']:.2f} ms, http - grpc {medians['http'] - medians['grpc']:+.2f}"
        " ms"
    )
    return {"rows": rows, "ttft_p50_ms": medians}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, action="append", help="default: 1 and 64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--ttft-requests", type=int, default=50)
    parser.add_argument("--model-vocab", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.concurrency = args.concurrency or [1, 64]
    cache = Path.home() / ".cache" / "mili" / "bench"
    model = build_model(cache / f"token-path-fit-v{args.model_vocab}", args.model_vocab)
    logs = Path(tempfile.mkdtemp(prefix="mili-http-api-"))
    print(f"model {model}; logs {logs}; load average {os.getloadavg()[0]:.2f}", flush=True)
    d = Deployment.start(ROOT, model, logs, "http", frontend_args=["--http-port", "0"])
    try:
        result = asyncio.run(bench(args, d))
    finally:
        d.stop()
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({**result, "config": vars(args)}, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
