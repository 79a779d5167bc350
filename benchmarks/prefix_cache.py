"""Prefix caching on a multi-turn chat workload: the same conversations with the cache on and off.

    --conversations C (16) conversations of --turns T (6) turns run concurrently, every one
    starting with the same --system-tokens S (1000) token system prompt; turn k sends the whole
    history (system prompt, every earlier user message and answer) plus a new user message of
    --user-tokens U (48) tokens and asks for --output-tokens O (32), greedy, ignore_eos.

Two `mili serve` deployments of the embedded demo model's architecture with --prefill-instances and
--decode-instances (2 each), started one after the other, the second with --no-prefix-cache,
run the identical workload. Reported side by side:

    TTFT p50/p90    client send -> first token, over all C x T requests
    KV bytes        payload decode received (mili_decode_kv_received_bytes_total, summed over
                    the decode instances' /metrics)
    prefill hit     prompt tokens prefill took from its cache (mili_prefill_prefix_cache_hit_
                    tokens) over the workload's possible maximum: for each request, the leading
                    full blocks of its prompt that prompts *finished before it was sent* already
                    held (at most all but the last token, as the cache allows), summed; and over
                    an upper bound, the same with every prompt *sent* before it
    output tokens   identical with the cache on and off (asserted: greedy equality)

The model is the demo model's shapes and tokenizer with its vocabulary left unpadded (random
weights, written once under --cache-dir): the demo checkpoint pads its embedding rows like Qwen3
does, and random weights, unlike trained ones, do sample those pad ids, which a client may not
send back as history (they are outside the tokenizer's vocabulary).

Targets (issue 18): TTFT p50 >= 3x lower with the cache, KV bytes >= 5x fewer, prefill hit rate
>= 90% of the maximum.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/prefix_cache.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.served, as a script

from benchmarks.served import mili_serve
from mili.engine.kv.block_hash import block_hashes
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
from mili.ports import pick_free

BLOCK_SIZE = 16  # the services' default
VOCAB = 800  # ids the demo tokenizer knows


@dataclass
class Sent:
    conversation: int
    turn: int
    prompt: list[int]
    sent_at: float
    done_at: float = 0.0
    ttft_s: float = 0.0
    output: list[int] = field(default_factory=list)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 104729 * i) % (VOCAB - 3) + 3 for i in range(n)]


def model_dir(cache_dir: Path) -> Path:
    """Demo shapes, unpadded vocabulary, the demo tokenizer's files linked beside the weights."""
    import dataclasses

    from mili.demo.model import default_model_dir, demo_config
    from mili.engine.model.checkpoint import cached_random_checkpoint
    from mili.engine.model.config import Qwen3Config

    demo = default_model_dir()
    padded = Qwen3Config.from_file(demo / "config.json")
    vocab = json.loads((demo / "tokenizer.json").read_text())
    num_tokens = len(vocab["model"]["vocab"]) + len(vocab.get("added_tokens", []))
    eos, bos = padded.eos_token_id, padded.bos_token_id
    assert isinstance(eos, int) and isinstance(bos, int)  # the demo model's: one id each
    config = dataclasses.replace(demo_config(num_tokens, eos, bos), vocab_size=num_tokens)
    weights = cached_random_checkpoint(config, "demo-unpadded", cache_dir)
    for path in demo.iterdir():
        if (
            path.suffix == ".json"
            and path.name != "config.json"
            and not (weights / path.name).exists()
        ):
            (weights / path.name).symlink_to(path)
    return weights


@contextlib.contextmanager
def deployment(args: argparse.Namespace, *, cache: bool) -> Iterator[tuple[str, list[str]]]:
    """`mili serve`; yields (frontend address, decode and prefill /metrics URLs)."""
    metrics_base = _free_run(2 + args.prefills + args.decodes)
    extra = ["--metrics-port", str(metrics_base), "--prefill-instances", str(args.prefills)]
    extra += ["--decode-instances", str(args.decodes)]
    # Every conversation's first turn arrives at once: room for all of them in the prefill
    # queues (the default, 4 x --max-batch-tokens, would refuse some with RESOURCE_EXHAUSTED).
    queue = args.conversations * (
        args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)
    )
    extra += ["--prefill-args", f"--max-queued-tokens {queue}"]
    if not cache:
        extra.append("--no-prefix-cache")
    urls = [
        f"http://127.0.0.1:{metrics_base + 2 + i}/metrics"
        for i in range(args.prefills + args.decodes)
    ]
    with mili_serve(args.model_dir, "float32", args.threads, "auto", extra) as served:
        yield served.address, urls


def _free_run(n: int) -> int:
    """A base port with `n` free ports from it (metrics of every child of mili serve)."""
    import socket

    for _ in range(50):
        base = pick_free("127.0.0.1")
        if base + n >= 65536:
            continue
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no run of {n} free ports")


def scrape(urls: list[str], name: str) -> float:
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            total += sum(float(m) for m in pattern.findall(r.read().decode()))
    return total


async def conversation(
    stub: generation_pb2_grpc.GenerationServiceStub,
    c: int,
    args: argparse.Namespace,
    log: list[Sent],
) -> None:
    history = tokens(0, args.system_tokens)  # every conversation shares the system prompt
    for turn in range(args.turns):
        prompt = history + tokens(1000 * c + turn + 1, args.user_tokens)
        request = generation_pb2.GenerateRequest(
            token_ids=prompt,
            sampling=sampling_pb2.SamplingParams(
                max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True
            ),
        )
        sent = Sent(c, turn, prompt, time.monotonic())
        log.append(sent)
        async for response in stub.Generate(request, timeout=600):
            if response.token_ids and not sent.output:
                sent.ttft_s = time.monotonic() - sent.sent_at
            sent.output.extend(response.token_ids)
        sent.done_at = time.monotonic()
        history = prompt + sent.output


async def workload(address: str, args: argparse.Namespace) -> list[Sent]:
    log: list[Sent] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await asyncio.gather(*(conversation(stub, c, args, log) for c in range(args.conversations)))
    return log


def possible_hit_tokens(log: list[Sent], *, finished: bool) -> int:
    """Sum over requests of their leading full prompt blocks that earlier prompts held: those
    finished before it was sent (`finished`), or every one sent before it (an upper bound no
    cache can pass: a prefix still being computed is at best reused chunk by chunk)."""
    total = 0
    for r in log:
        earlier = [
            e for e in log if (e.done_at <= r.sent_at if finished else e.sent_at < r.sent_at)
        ]
        held = {k for e in earlier for k in block_hashes(e.prompt, BLOCK_SIZE)}
        n = 0
        for key in block_hashes(r.prompt, BLOCK_SIZE)[: (len(r.prompt) - 1) // BLOCK_SIZE]:
            if key not in held:
                break
            n += 1
        total += n * BLOCK_SIZE
    return total


def run(args: argparse.Namespace, *, cache: bool) -> dict[str, Any]:
    with deployment(args, cache=cache) as (address, urls):
        prefill_urls, decode_urls = urls[: args.prefills], urls[args.prefills :]
        started = time.monotonic()
        log = asyncio.run(workload(address, args))
        wall = time.monotonic() - started
        time.sleep(0.5)
        kv_bytes = scrape(decode_urls, "mili_decode_kv_received_bytes_total")
        hit = scrape(prefill_urls, "mili_prefill_prefix_cache_hit_tokens_total")
    ttfts = sorted(s.ttft_s * 1e3 for s in log)
    possible = possible_hit_tokens(log, finished=True)
    upper = possible_hit_tokens(log, finished=False)
    return {
        "cache": cache,
        "requests": len(log),
        "wall_s": wall,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
        "kv_bytes": kv_bytes,
        "prefill_hit_tokens": hit,
        "possible_hit_tokens": possible,
        "upper_bound_hit_tokens": upper,
        "prompt_tokens": sum(len(s.prompt) for s in log),
        "outputs": {(s.conversation, s.turn): s.output for s in log},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--prefills", type=int, default=2)
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per service")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "mili" / "bench")
    args = parser.parse_args()
    args.model_dir = model_dir(args.cache_dir)

    on = run(args, cache=True)
    off = run(args, cache=False)
    same = on.pop("outputs") == off.pop("outputs")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "on": on,
        "off": off,
        "ttft_p50_ratio": off["ttft_p50_ms"] / on["ttft_p50_ms"],
        "kv_bytes_ratio": off["kv_bytes"] / max(on["kv_bytes"], 1.0),
        "hit_rate_of_possible": on["prefill_hit_tokens"] / max(on["possible_hit_tokens"], 1),
        "hit_rate_of_upper_bound": on["prefill_hit_tokens"] / max(on["upper_bound_hit_tokens"], 1),
        "greedy_equal": same,
    }
    print(f"{'':24}{'cache on':>14}{'cache off':>14}")
    for key in (
        "requests",
        "wall_s",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "kv_bytes",
        "prefill_hit_tokens",
    ):
        print(f"{key:24}{on[key]:>14,.1f}{off[key]:>14,.1f}")
    print(f"TTFT p50 off/on        {result['ttft_p50_ratio']:.2f}x   (target >= 3)")
    print(f"KV bytes off/on        {result['kv_bytes_ratio']:.2f}x   (target >= 5)")
    print(
        f"prefill hit / possible {result['hit_rate_of_possible']:.1%}  "
        f"({on['prefill_hit_tokens']:.0f} of {on['possible_hit_tokens']} tokens; target >= 90%)"
    )
    print(
        f"prefill hit / bound    {result['hit_rate_of_upper_bound']:.1%}  "
        f"(of {on['upper_bound_hit_tokens']} tokens that any earlier-sent prompt held)"
    )
    print(f"greedy outputs equal   {same}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not same:
        sys.exit("outputs differ with the cache on and off")


if __name__ == "__main__":
    main()
