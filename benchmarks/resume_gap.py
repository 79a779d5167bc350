"""The gaps a stream that is never preempted sees while other requests are preempted and
resumed, several source trees side by side.

A preempted request's K/V is computed again on decode when it resumes, between the batch's
steps: every running stream waits for that work. All at once, a long context stalls them
for its whole recompute; in chunks, for one chunk a batch iteration. p99 of the inter-token
gaps cannot tell (a handful of resumes among thousands of gaps); the largest gaps can.

Each tree (`--tree`, repeatable) runs its own `mili serve` on the embedded demo model (one
torch thread per service, prefix caching off), decode with `--num-blocks` blocks of 16
tokens. A round: an observer (priority 0, a short prompt, greedy, ignore_eos) starts alone;
a second later --requests heavy requests (priority 1, --prompt-tokens random ids,
--max-tokens each, ignore_eos) start at once and outgrow the pool together, so the heavy ones
are preempted and resumed while the observer runs; the observer is cancelled when the last
heavy one ends (or ends first: `observed` says how much of their run it saw). Only the
observer's gaps while heavy requests ran are kept. Rounds alternate
the trees, order flipped every round; per round and tree: the heavy requests' output tok/s,
the observer's gap p50 / p99 / max, the count over 100 ms and the five largest, and the
preemptions decode counted.

    git worktree add /tmp/mili-allatonce 637957e
    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/resume_gap.py \\
        --tree /tmp/mili-allatonce --tree . --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
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


async def stream(
    stub: generation_pb2_grpc.GenerationServiceStub,
    prompt: list[int],
    max_tokens: int,
    priority: int,
    arrivals: list[float] | None = None,
) -> int:
    """Generate to the end; the tokens it got. `arrivals`: each token message's time."""
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(token_ids=prompt, sampling=sampling, priority=priority)
    num_tokens = 0
    async for message in stub.Generate(request, timeout=1800):
        if message.token_ids:
            num_tokens += len(message.token_ids)
            if arrivals is not None:
                arrivals.append(time.perf_counter())
    return num_tokens


async def one_round(address: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    observer_prompt = [rng.randrange(3, VOCAB - 3) for _ in range(16)]
    heavy_prompts = [
        [rng.randrange(3, VOCAB - 3) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        arrivals: list[float] = []
        observer = asyncio.create_task(
            stream(stub, observer_prompt, args.observer_tokens, 0, arrivals)
        )
        await asyncio.sleep(1.0)
        started = time.perf_counter()
        counts = await asyncio.gather(*(stream(stub, p, args.max_tokens, 1) for p in heavy_prompts))
        ended = time.perf_counter()
        observer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await observer
    during = [t for t in arrivals if started <= t <= ended]
    gaps = sorted(b - a for a, b in itertools.pairwise(during))
    return {
        "heavy_tok_s": sum(counts) / (ended - started),
        # how much of the heavy requests' run the observer saw (it may end first)
        "observed": (during[-1] - started) / (ended - started),
        "num_gaps": len(gaps),
        "gap_p50_ms": statistics.median(gaps) * 1e3,
        "gap_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
        "gap_max_ms": gaps[-1] * 1e3,
        "gaps_over_100ms": sum(g > 0.1 for g in gaps),
        "top5_ms": [round(g * 1e3) for g in gaps[-5:]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="source tree (repeat)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=500, help="decode's KV pool")
    parser.add_argument("--requests", type=int, default=6, help="heavy requests")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="of each heavy one")
    parser.add_argument("--max-tokens", type=int, default=1500, help="of each heavy one")
    parser.add_argument("--observer-tokens", type=int, default=4000)
    parser.add_argument("--attention", default="torch", help="every tree's --attention")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree or [ROOT]]
    print(f"load average {os.getloadavg()}", flush=True)
    rounds: list[list[dict[str, Any]]] = [[] for _ in trees]
    with contextlib.ExitStack() as stack:
        extra = ["--decode-args", f"--num-blocks {args.num_blocks}", "--no-prefix-cache"]
        model_dir = default_model_dir()  # one model for every tree
        served = [
            stack.enter_context(
                mili_serve(model_dir, "float32", 1, args.attention, extra, metrics=True, tree=t)
            )
            for t in trees
        ]
        for r in range(args.rounds):
            order = list(range(len(trees)))
            if r % 2:
                order.reverse()
            for i in order:
                url = served[i].metrics["decode-0"]
                before = service_metrics.scrape(url).get(PREEMPTIONS, 0.0)
                out = asyncio.run(one_round(served[i].address, args, seed=r))
                out["preemptions"] = service_metrics.scrape(url).get(PREEMPTIONS, 0.0) - before
                rounds[i].append(out)
                print(f"round {r} tree{i}: {json.dumps(out)}", flush=True)
    print(
        f"\nobserver (priority 0) beside {args.requests} heavy requests ({args.prompt_tokens}-"
        f"token prompts, {args.max_tokens} tokens, priority 1); decode pool {args.num_blocks}"
        " blocks of 16; per round"
    )
    print(
        "| tree | round | heavy tok/s | observed | gap p50 / p99 / max ms | gaps > 100 ms "
        "| preemptions |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, tree in enumerate(trees):
        for r, o in enumerate(rounds[i]):
            print(
                f"| tree{i} {tree} | {r} | {o['heavy_tok_s']:.1f} | {o['observed']:.0%} | "
                f"{o['gap_p50_ms']:.1f} / "
                f"{o['gap_p99_ms']:.1f} / {o['gap_max_ms']:.0f} | {o['gaps_over_100ms']} | "
                f"{o['preemptions']:.0f} |"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"tree": [str(t) for t in trees]}, "rounds": rounds},
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
