"""Requests that ask for far more tokens than they write: how many decode runs at once, and
what that does to throughput, several source trees side by side.

A client that does not know how long an answer will be asks for a large max_tokens (an agent
library sending none gets the context's room). A decode instance that reserves KV for prompt +
max_tokens at admission holds a few of them at a time; one that reserves the first outputs and
grows the blocks as they are written holds as many as the blocks written fit, preempting the
newest when they outgrow the pool.

Each tree (`--tree`, repeatable; e.g. a checkout of main beside this branch) runs its own
`mili serve` on the embedded demo model (one torch thread per service), decode with
`--num-blocks` blocks of 16 tokens. The workload: --requests prompts of --prompt-tokens random
ids sent at once, greedy, ignore_eos, max_tokens --max-tokens, each ended by a stop token id
chosen so that it stops after --min-output..--max-output tokens: a probe (the first tree,
greedy, once) gives each prompt's tokens and the stop id is the one at a random index of that
range where it first occurs (else at any index of it: the run is shorter), its first occurrence
the length. Every tree must give exactly those lengths (it is checked).
Rounds alternate the trees, order flipped every round. Per tree: the median over rounds of the
wall time and output tokens/s, the preemptions its decode counted (trees that count them), and
the ratio of its tok/s over the first tree's.

    git worktree add /tmp/mili-main 133f0ec
    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/kv_growth.py \\
        --tree /tmp/mili-main --tree . --rounds 3
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

from benchmarks import service_metrics
from benchmarks.served import mili_serve
from mili.demo.model import default_model_dir
from mili.pb.common.v1 import sampling_pb2
from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 800  # ids the demo tokenizer knows
PREEMPTIONS = "mili_decode_preemptions_total"


async def complete(
    stub: generation_pb2_grpc.GenerationServiceStub,
    prompt: list[int],
    max_tokens: int,
    stop_token_id: int | None = None,
) -> list[int]:
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if stop_token_id is not None:
        sampling.stop_token_ids.append(stop_token_id)
    request = generation_pb2.CompleteRequest(token_ids=prompt, sampling=sampling)
    reply = await stub.Complete(request, timeout=900)
    return list(reply.token_ids)


async def probe(
    address: str, prompts: list[list[int]], args: argparse.Namespace, rng: random.Random
) -> list[tuple[int, int]]:
    """Per prompt: a stop id and the length it gives (its first occurrence in the greedy run)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        runs = await asyncio.gather(*(complete(stub, p, args.max_output) for p in prompts))
    plan = []
    for tokens in runs:
        # an index in the range whose token is new there (greedy output repeats itself)
        new = [
            k for k in range(args.min_output - 1, args.max_output) if tokens[k] not in tokens[:k]
        ]
        stop = tokens[
            rng.choice(new) if new else rng.randrange(args.min_output - 1, args.max_output)
        ]
        plan.append((stop, tokens.index(stop) + 1))
    return plan


async def one_round(
    address: str, prompts: list[list[int]], plan: list[tuple[int, int]], max_tokens: int
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        started = time.perf_counter()
        runs = await asyncio.gather(
            *(
                complete(stub, p, max_tokens, stop)
                for p, (stop, _) in zip(prompts, plan, strict=True)
            )
        )
        wall_s = time.perf_counter() - started
    lengths = [len(tokens) for tokens in runs]
    expected = [length for _, length in plan]
    assert lengths == expected, f"lengths {lengths} != the probe's {expected}"
    return {"wall_s": wall_s, "tok_s": sum(lengths) / wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="source tree (repeat)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=512, help="decode's KV pool")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--min-output", type=int, default=40)
    parser.add_argument("--max-output", type=int, default=160)
    parser.add_argument("--attention", default="torch", help="every tree's --attention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, VOCAB - 3) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    print(f"load average {os.getloadavg()}, {platform.node()}", flush=True)
    results: list[list[dict[str, Any]]] = [[] for _ in trees]
    preemptions: list[float | None] = []
    with contextlib.ExitStack() as stack:
        extra = ["--decode-args", f"--num-blocks {args.num_blocks}", "--no-prefix-cache"]
        model_dir = default_model_dir()  # one model for every tree
        served = [
            stack.enter_context(
                mili_serve(model_dir, "float32", 1, args.attention, extra, metrics=True, tree=t)
            )
            for t in trees
        ]
        plan = asyncio.run(probe(served[0].address, prompts, args, rng))
        print(f"lengths {sorted(length for _, length in plan)}", flush=True)
        before = [service_metrics.scrape(s.metrics["decode-0"]) for s in served]
        for r in range(args.rounds):
            order = list(range(len(trees)))
            if r % 2:
                order.reverse()
            for i in order:
                out = asyncio.run(one_round(served[i].address, prompts, plan, args.max_tokens))
                results[i].append(out)
                print(
                    f"round {r} tree{i}: {out['wall_s']:.2f} s, {out['tok_s']:.0f} tok/s "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
        for s, b in zip(served, before, strict=True):
            after = service_metrics.scrape(s.metrics["decode-0"])
            preemptions.append(
                after[PREEMPTIONS] - b[PREEMPTIONS] if PREEMPTIONS in after else None
            )
    rows = []
    for i, tree in enumerate(trees):
        rows.append(
            {
                "tree": str(tree),
                "wall_s": statistics.median(o["wall_s"] for o in results[i]),
                "tok_s": statistics.median(o["tok_s"] for o in results[i]),
                "preemptions": preemptions[i],
            }
        )
    print(
        f"\n{args.requests} requests at once, {args.prompt_tokens}-token prompts, max_tokens "
        f"{args.max_tokens}, stopped after {args.min_output}..{args.max_output} tokens; decode "
        f"pool {args.num_blocks} blocks of 16; median of {args.rounds} rounds (x: over tree0)"
    )
    print("| tree | wall s | output tok/s | preemptions (all rounds) |")
    print("| --- | --- | --- | --- |")
    for i, row in enumerate(rows):
        ratio = "" if i == 0 else f" ({row['tok_s'] / rows[0]['tok_s']:.2f}x)"
        count = "not counted" if row["preemptions"] is None else f"{row['preemptions']:.0f}"
        print(
            f"| tree{i} {row['tree']} | {row['wall_s']:.2f} | {row['tok_s']:.0f}{ratio} | {count} |"
        )
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
