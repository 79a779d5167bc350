"""Head-of-line blocking on a prefill instance: short prompts' TTFT while a long prompt is being
prefilled, several source trees side by side.

Each tree (`--tree`, repeatable; e.g. a checkout of main beside this branch) runs its own
`mili serve` (`python -m mili serve` with the tree as working directory and on PYTHONPATH, one
torch thread per service) on the embedded demo model, prefill with `--max-batch-tokens`
(default 512: the demo model's context is 4096 tokens, so a 4000-token prompt is 8 chunks, as a
16k-token prompt is at the default budget of 2048). Rounds alternate the trees, order flipped
every round, so the machine's other load hits each alike. One round, per tree:

    alone   the long prompt (--long-tokens) by itself, then one short prompt by itself:
            their TTFT with nothing in the way (a change must not slow a lone prompt)
    mixed   the long prompt, then --shorts short prompts (--short-tokens each), the first
            --delay-ms after it, one every --interval-ms: the shorts' TTFT (p50, max) and the
            long prompt's

Every prompt is random token ids, new each round (no prefix-cache hits), max_tokens 1,
ignore_eos; TTFT is client send -> first token. Per tree: the medians over rounds of the
long prompt's and the short's TTFT alone, of the long prompt's TTFT mixed, and of each round's
short p50 and max, in ms; the ratios are each tree's over the first tree's.

    git worktree add /tmp/mili-main main
    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/prefill_fairness.py \\
        --tree /tmp/mili-main --tree . --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.served, as a script

from benchmarks.served import mili_serve
from mili.demo.model import default_model_dir
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 800  # ids the demo tokenizer knows
MAX_QUEUED_TOKENS = 16384  # room for the long prompt and every short one, twice over


async def ttft_ms(stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int]) -> float:
    request = generation_pb2.GenerateRequest(
        token_ids=prompt,
        sampling=sampling_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )
    sent_at = time.perf_counter()
    ttft = None
    async for response in stub.Generate(request, timeout=600):
        if response.token_ids and ttft is None:
            ttft = (time.perf_counter() - sent_at) * 1e3
    assert ttft is not None, "no token came back"
    return ttft


async def later(delay_s: float, stub: Any, prompt: list[int]) -> float:
    await asyncio.sleep(delay_s)
    return await ttft_ms(stub, prompt)


async def one_round(address: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB - 3) for _ in range(n)]

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        long_alone = await ttft_ms(stub, prompt(args.long_tokens))
        short_alone = await ttft_ms(stub, prompt(args.short_tokens))
        delays = [(args.delay_ms + k * args.interval_ms) / 1e3 for k in range(args.shorts)]
        long_mixed, *shorts = await asyncio.gather(
            ttft_ms(stub, prompt(args.long_tokens)),
            *(later(d, stub, prompt(args.short_tokens)) for d in delays),
        )
    return {
        "long_alone_ms": long_alone,
        "short_alone_ms": short_alone,
        "long_mixed_ms": long_mixed,
        "short_p50_ms": statistics.median(shorts),
        "short_max_ms": max(shorts),
        "shorts_ms": shorts,
    }


COLUMNS = ("long_alone_ms", "short_alone_ms", "long_mixed_ms", "short_p50_ms", "short_max_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="source tree (repeat)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=100.0)
    parser.add_argument("--interval-ms", type=float, default=300.0)
    parser.add_argument("--attention", default="torch", help="every tree's --attention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    print(f"load average {os.getloadavg()}, {platform.node()}", flush=True)
    results: list[list[dict[str, Any]]] = [[] for _ in trees]
    with contextlib.ExitStack() as stack:
        # the queue bound (4x the budget by default) would refuse the long prompt
        prefill = (
            f"--max-batch-tokens {args.max_batch_tokens} --max-queued-tokens {MAX_QUEUED_TOKENS}"
        )
        extra = ["--prefill-args", prefill]
        model_dir = default_model_dir()  # one model for every tree
        addresses = [
            stack.enter_context(
                mili_serve(model_dir, "float32", 1, args.attention, extra, tree=t)
            ).address
            for t in trees
        ]
        for i, address in enumerate(addresses):  # warm-up: first calls load and compile lazily
            asyncio.run(one_round(address, args, random.Random(-1 - i)))
        for r in range(args.rounds):
            order = list(range(len(trees)))
            if r % 2:
                order.reverse()
            for i in order:
                rng = random.Random(args.seed * 1000 + r * 10 + i)
                out = asyncio.run(one_round(addresses[i], args, rng))
                results[i].append(out)
                print(
                    f"round {r} tree{i}: "
                    + ", ".join(f"{k.removesuffix('_ms')} {out[k]:.0f}" for k in COLUMNS)
                    + f" (load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    rows = []
    for i, tree in enumerate(trees):
        row: dict[str, Any] = {"tree": str(tree)}
        row |= {k: statistics.median(o[k] for o in results[i]) for k in COLUMNS}
        rows.append(row)
    print(
        f"\nlong {args.long_tokens} tokens, {args.shorts} shorts of {args.short_tokens}, "
        f"max_batch_tokens {args.max_batch_tokens}; ms, median of {args.rounds} rounds "
        "(x: over tree0)"
    )
    print("| tree | long alone | short alone | long mixed | short p50 mixed | short max mixed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, row in enumerate(rows):
        cells = [
            f"{row[k]:.0f}" + ("" if i == 0 else f" ({row[k] / rows[0][k]:.2f}x)") for k in COLUMNS
        ]
        print(f"| tree{i} {row['tree']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"tree": [str(t) for t in trees]},
                    "rows": rows,
                    "rounds": results,
                },
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
