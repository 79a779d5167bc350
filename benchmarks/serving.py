"""Serving on CPU through `mili serve`: continuous batching gain, and the pipeline's per-token cost.

Two measurements, each a ratio whose two sides are measured in the same run close together in
time (the machine is shared and noisy):

  batching   the embedded demo model (--batching-dtype, default float32) behind one `mili serve`;
             the same 16 requests (token-id prompts of 64 ids, 64 output tokens, ignore_eos,
             temperature 0: `mili bench`'s prompts and client; no prefix caching, so every
             run prefills them in full) run (a) one at a time and
             (b) all 16 at once; output tokens/s of each and ratio = (b) / (a), the median over
             --batching-repeats pairs. Target: >= 4x. For reference, the same requests through
             generate() in this process (the engine's own gain, no services) after each pair.

  overhead   a random-weight Qwen3-0.6B (preset "qwen3-0.6b", a bf16 checkpoint written once into
             --cache-dir and reused, shared with kv_handoff.py and generate_cpu.py; served with
             the demo model's tokenizer files linked beside it, prompt ids < 256), batch 1,
             --overhead-dtype (default bfloat16: on par with float32 per decode step on this
             CPU, half the memory; `auto` measures both first and serves the cheaper):
               bare  Qwen3ForCausalLM.decode on a DecodeBatch of 1 in this process after a
                     128-token prefill, feeding back the greedy token; "step" adds
                     DecodeBatch.build and the Sampler, what the decode service's batch thread
                     runs per step besides its bookkeeping
               ITL   inter-token latency at a streaming client through the whole pipeline
                     (decode -> frontend -> tokenizer DetokenizeStream -> frontend -> client)
             --rounds rounds of (output - 1 bare steps, one request of --overhead-output tokens)
             alternate, so others' load hits both sides alike. ratio = median ITL / median bare
             decode. Target: <= 1.15x.

Both report the CPU time each process spent per output token (/proc/PID/stat of the children of
`mili serve`; this process for the client): far less sensitive to others' load than wall time,
and it shows where the cores go. `overhead` counts it while tokens stream (2nd to last token, so
admission, prefill and the KV hand-off are left out) and compares the decode process's CPU per
step with the bare step's.

Threads: no service sets torch's thread count (torch then takes one per core in every process),
so this script sets OMP_NUM_THREADS / MKL_NUM_THREADS = --threads in the environment of
`mili serve`, which its children inherit, and torch.set_num_threads(--threads) here.

Others benchmark on the same machine: run it under the shared lock (2-3 minutes), e.g.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/serving.py --json serving.json
    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/serving.py --only overhead --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.served, as a script

from benchmarks.served import (
    BLOCK_SIZE,
    MODEL,
    TOKEN_ID_RANGE,
    BareDecode,
    CpuMeter,
    bench_args,
    checkpoint_dir,
    demo_dir,
    load_model,
    mili_serve,
    run_bench,
    servable,
)
from mili.client import bench_clients
from mili.client.bench_report import percentile
from mili.engine.generate import generate
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- 1. continuous batching ------------------------------------------------------------------


def engine_tok_s(
    model: Qwen3ForCausalLM, prompts: list[list[int]], output: int
) -> tuple[float, float]:
    """Output tokens/s of generate() in this process: one prompt at a time, then all at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        generate(model, [prompt], params)
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(model, prompts, params)
    batched_s = time.perf_counter() - start
    num_tokens = len(prompts) * output
    return num_tokens / sequential_s, num_tokens / batched_s


def measure_batching(args: argparse.Namespace) -> dict[str, Any]:
    n, prompt, output = args.batching_requests, args.batching_prompt, args.batching_output
    num_blocks = n * -(-(prompt + output) // BLOCK_SIZE) + 16
    # The same prompts run again and again: prefix caching would prefill all but their last
    # block from the cache after the first run, and the runs would not compare.
    extra = [
        "--no-prefix-cache",
        f"--decode-args=--num-blocks {num_blocks} --max-running {max(n, 16)}",
    ]
    model_dir = demo_dir()
    torch.set_num_threads(args.threads)
    model = load_model(model_dir, dtype=DTYPES[args.batching_dtype], attention=args.attention)
    low, high = (int(x) for x in TOKEN_ID_RANGE.split(":"))
    prompts = [bench_clients.prompt_ids(i, prompt, low, high, seed=0) for i in range(n)]  # bench's
    engine_tok_s(model, prompts[:2], 4)  # warm-up
    engine: list[tuple[float, float]] = []
    with mili_serve(model_dir, args.batching_dtype, args.threads, args.attention, extra) as served:
        # Warm-up: first calls allocate and pick kernels; one burst at full width, one alone.
        run_bench(bench_args(served.address, n, n, prompt, 8, seed=99))
        run_bench(bench_args(served.address, 1, 1, prompt, 8, seed=98))
        meter = served.cpu
        runs = []
        cpu: dict[str, dict[str, float]] = {"sequential": {}, "concurrent": {}}
        for _ in range(args.batching_repeats):
            with meter.measure(cpu["sequential"]):
                sequential = run_bench(bench_args(served.address, 1, n, prompt, output))
            with meter.measure(cpu["concurrent"]):
                concurrent = run_bench(bench_args(served.address, n, n, prompt, output))
            runs.append((sequential, concurrent))
            engine.append(engine_tok_s(model, prompts, output))  # services idle meanwhile
    num_tokens = args.batching_repeats * n * output
    ratios = [c["output_tokens_per_s"] / s["output_tokens_per_s"] for s, c in runs]
    best = min(range(len(runs)), key=lambda i: abs(ratios[i] - statistics.median(ratios)))
    sequential, concurrent = runs[best]  # the run whose ratio is the median one
    return {
        "model": f"demo ({model_dir.name})",
        "dtype": args.batching_dtype,
        "threads": args.threads,
        "requests": n,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "sequential_tok_s": sequential["output_tokens_per_s"],
        "concurrent_tok_s": concurrent["output_tokens_per_s"],
        "ratio": statistics.median(ratios),
        # The same requests through generate() in one process: the engine's own batching gain.
        "engine_sequential_tok_s": statistics.median(e[0] for e in engine),
        "engine_batched_tok_s": statistics.median(e[1] for e in engine),
        "engine_ratio": statistics.median(e[1] / e[0] for e in engine),
        "sequential_wall_s": sequential["wall_s"],
        "concurrent_wall_s": concurrent["wall_s"],
        "sequential_itl_p50_ms": sequential["itl"]["p50_ms"],
        "concurrent_itl_p50_ms": concurrent["itl"]["p50_ms"],
        "concurrent_ttft_p50_ms": concurrent["ttft"]["p50_ms"],
        # Steady-state gain of the decode steps alone (no prefill phases): n tokens per
        # concurrent ITL against one per sequential ITL, medians over the repeats.
        "step_ratio": statistics.median(
            n * s["itl"]["p50_ms"] / c["itl"]["p50_ms"] for s, c in runs
        ),
        # CPU ms per output token of each process, summed over the repeats: where cores go.
        "cpu_ms_per_token": {
            mode: {k: round(v / num_tokens * 1e3, 3) for k, v in by.items()}
            for mode, by in cpu.items()
        },
        "runs_ratio": [round(r, 2) for r in ratios],
        "runs_tok_s": [
            [round(s["output_tokens_per_s"], 1), round(c["output_tokens_per_s"], 1)]
            for s, c in runs
        ],
    }


# ---- 2. serving overhead ---------------------------------------------------------------------


def pick_dtype(
    weights: Path, prompt: list[int], steps: int, cpu_clock: Callable[[], float], attention: str
) -> tuple[str, dict[str, dict[str, float]]]:
    """The dtype whose batch-1 decode step takes less CPU: single steps of each, alternated.

    CPU time, not wall time: on a shared machine a step that lost its core for a while says
    nothing about the dtype.
    """
    seqs = {
        name: BareDecode(load_model(weights, dtype=dt, attention=attention), prompt, steps + 2)
        for name, dt in DTYPES.items()
    }
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in seqs}
    for i in range(steps + 2):
        for name, seq in seqs.items():
            if i >= 2:  # the first steps warm up
                runs[name].append(seq.step(cpu_clock))
            else:
                seq.step(cpu_clock)
    probe = {
        name: {
            "decode_ms": statistics.median(r[0] for r in rs) * 1e3,
            "cpu_ms": statistics.median(r[2] for r in rs) * 1e3,
        }
        for name, rs in runs.items()
    }
    del seqs
    return min(probe, key=lambda n: probe[n]["cpu_ms"]), probe


async def stream_one(
    address: str, prompt: list[int], output: int, name: str, meter: CpuMeter, cpu: dict[str, float]
) -> list[float]:
    """ITLs (s) of one streaming Generate through the frontend, timed as `mili bench` does.

    Adds to `cpu` what each process spent from the 2nd token's arrival to the last's: steps
    3..output of decode and their trip to the client, without the request's admission,
    prefill and KV hand-off.
    """
    from mili.pb.common.v1 import sampling_pb2
    from mili.pb.frontend.v1 import generation_pb2, generation_pb2_grpc
    from mili.rpc.client import insecure_channel

    itl_s: list[float] = []
    received = 0
    async with insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await stub.Info(generation_pb2.InfoRequest(), timeout=10)  # connected before timing
        request = generation_pb2.GenerateRequest(
            request_id=f"serving-{name}-{time.monotonic_ns()}",
            token_ids=prompt,
            sampling=sampling_pb2.SamplingParams(
                max_tokens=output, temperature=0.0, ignore_eos=True
            ),
        )
        last = None
        with contextlib.ExitStack() as streaming:
            async for response in stub.Generate(request, timeout=600.0):
                now = time.perf_counter()
                n = len(response.token_ids)
                if not n:
                    continue
                if last is not None:
                    itl_s += [(now - last) / n] * n  # as mili bench: k tokens, k gaps of gap/k
                last = now
                before = received
                received += n
                if before < 2 <= received:
                    streaming.enter_context(meter.measure(cpu))
    if received != output:
        raise RuntimeError(f"request {name}: {received} of {output} tokens")
    return itl_s


def measure_overhead(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    weights = checkpoint_dir(args.cache_dir)
    low, high = (int(x) for x in TOKEN_ID_RANGE.split(":"))
    prompt = bench_clients.prompt_ids(0, args.overhead_prompt, low, high, seed=0)
    steps = args.overhead_output  # the pipeline's first token is prefill's: output - 1 ITLs
    # One torch thread: the bare run is this thread alone (gRPC's poller thread is not counted).
    cpu_clock = time.thread_time if args.threads == 1 else time.process_time
    probe: dict[str, dict[str, float]] = {}
    dtype = args.overhead_dtype
    if dtype == "auto":
        dtype, probe = pick_dtype(weights, prompt, args.probe_steps, cpu_clock, args.attention)
    model = load_model(weights, dtype=DTYPES[dtype], attention=args.attention)
    num_blocks = -(-(args.overhead_prompt + steps) // BLOCK_SIZE) + 4
    extra = [
        f"--decode-args=--num-blocks {num_blocks} --max-running 4",
        f"--prefill-args=--num-blocks {num_blocks} --max-queued-tokens {num_blocks * BLOCK_SIZE}",
    ]
    decode_s: list[float] = []
    step_s: list[float] = []
    itl_s: list[float] = []
    rounds: list[dict[str, float]] = []
    cpu: dict[str, float] = {}
    idle_cpu: dict[str, float] = {}
    bare_cpu_s = 0.0
    with (
        servable(weights) as model_dir,
        mili_serve(model_dir, dtype, args.threads, args.attention, extra) as s,
    ):
        warm = BareDecode(model, prompt[:16], 4)  # warm-up, both sides
        for _ in range(4):
            warm.step(cpu_clock)
        meter = s.cpu
        asyncio.run(stream_one(s.address, prompt[:16], 4, "warm-up", meter, {}))
        for r in range(args.rounds):
            seq = BareDecode(model, prompt, steps - 1)  # its prefill is not measured
            with meter.measure(idle_cpu):  # what the idle services burn meanwhile
                bare = [seq.step(cpu_clock) for _ in range(steps - 1)]
            itl = asyncio.run(stream_one(s.address, prompt, steps, str(r), meter, cpu))
            d = [b[0] for b in bare]
            decode_s += d
            step_s += [b[1] for b in bare]
            bare_cpu_s += sum(b[2] for b in bare)
            itl_s += itl
            rounds.append(
                {
                    "decode_ms": statistics.median(d) * 1e3,
                    "itl_ms": statistics.median(itl) * 1e3,
                    "ratio": statistics.median(itl) / statistics.median(d),
                }
            )
    decode_ms = statistics.median(decode_s) * 1e3
    itl_ms = statistics.median(itl_s) * 1e3
    bare_cpu_ms = bare_cpu_s / len(decode_s) * 1e3
    streamed = args.rounds * (steps - 2)
    return {
        "model": f"{MODEL} random weights ({weights.name})",
        "dtype": dtype,
        "dtype_probe": probe,
        "threads": args.threads,
        "prompt_tokens": args.overhead_prompt,
        "output_tokens": steps,
        "rounds": args.rounds,
        "bare_decode_ms": decode_ms,
        "bare_step_ms": statistics.median(step_s) * 1e3,
        "itl_ms": itl_ms,
        "itl_p90_ms": percentile(itl_s, 90) * 1e3,  # type: ignore[operator]
        "ratio": itl_ms / decode_ms,
        "median_round_ratio": statistics.median(r["ratio"] for r in rounds),
        # Mean CPU ms per decode step: the bare step (this thread), and each process of the
        # pipeline while it streams (2nd to last token: output - 2 steps per request).
        "bare_cpu_ms_per_step": bare_cpu_ms,
        "streaming_cpu_ms_per_step": {k: round(v / streamed * 1e3, 3) for k, v in cpu.items()},
        # Load-independent cross-check: the decode process's CPU per step over the bare step's.
        "cpu_ratio": cpu["decode"] / streamed * 1e3 / bare_cpu_ms,
        "services_cpu_ms_per_bare_step": {
            k: round(v / len(decode_s) * 1e3, 3) for k, v in idle_cpu.items() if k != "client"
        },
        "per_round": [{k: round(v, 3) for k, v in r.items()} for r in rounds],
    }


# ---- report ----------------------------------------------------------------------------------


def _cpu_lines(cpu: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"CPU ms per output token, {mode}: "
        + ", ".join(f"{k} {v:.2f}" for k, v in by.items())
        + f" (sum {sum(by.values()):.2f})"
        for mode, by in cpu.items()
    ]


def report(result: dict[str, Any]) -> str:
    lines = [
        f"MILI serving benchmark, {result['date']}, {result['machine']}",
        f"torch {result['torch']}, threads {result['threads']} (bare: torch.set_num_threads; "
        "services: OMP_NUM_THREADS/MKL_NUM_THREADS)",
        "",
    ]
    b = result.get("batching")
    if b:
        lines += [
            f"1. continuous batching: {b['model']}, {b['dtype']}, {b['requests']} requests x "
            f"{b['prompt_tokens']} prompt + {b['output_tokens']} output tokens",
            "| mode | output tok/s | wall s | ITL p50 ms |",
            "| --- | --- | --- | --- |",
            f"| sequential (1 at a time) | {b['sequential_tok_s']:.1f} | "
            f"{b['sequential_wall_s']:.2f} | {b['sequential_itl_p50_ms']:.2f} |",
            f"| concurrent ({b['requests']} at once) | {b['concurrent_tok_s']:.1f} | "
            f"{b['concurrent_wall_s']:.2f} | {b['concurrent_itl_p50_ms']:.2f} |",
            f"| engine alone: generate(), 1 prompt at a time | {b['engine_sequential_tok_s']:.1f}"
            " | - | - |",
            f"| engine alone: generate(), {b['requests']} prompts at once | "
            f"{b['engine_batched_tok_s']:.1f} | - | - |",
            f"engine alone ratio {b['engine_ratio']:.2f}x; decode steps alone ({b['requests']} x "
            f"sequential ITL / concurrent ITL) {b['step_ratio']:.2f}x; concurrent TTFT p50 "
            f"{b['concurrent_ttft_p50_ms']:.0f} ms",
            f"ratio concurrent/sequential {b['ratio']:.2f}x (target >= 4x: "
            f"{'met' if b['ratio'] >= 4 else 'MISSED'}); runs {b['runs_ratio']}",
            *_cpu_lines(b["cpu_ms_per_token"]),
            "",
        ]
    o = result.get("overhead")
    if o:
        probe = ", ".join(
            f"{k} decode {v['decode_ms']:.0f} ms, CPU {v['cpu_ms']:.0f} ms"
            for k, v in o["dtype_probe"].items()
        )
        lines += [
            f"2. serving overhead: {o['model']}, {o['dtype']}"
            + (f" (probe: {probe})" if probe else "")
            + f", batch 1, {o['prompt_tokens']}-token prompt, {o['output_tokens']} output "
            f"tokens, {o['rounds']} rounds",
            "| what | median ms |",
            "| --- | --- |",
            f"| bare model.decode | {o['bare_decode_ms']:.1f} |",
            f"| bare step (build + decode + sample) | {o['bare_step_ms']:.1f} |",
            f"| ITL through mili serve (p90 {o['itl_p90_ms']:.1f}) | {o['itl_ms']:.1f} |",
            f"ratio ITL/decode {o['ratio']:.3f}x (target <= 1.15x: "
            f"{'met' if o['ratio'] <= 1.15 else 'MISSED'}); per round "
            f"{[round(r['ratio'], 2) for r in o['per_round']]}, median "
            f"{o['median_round_ratio']:.3f}x",
            f"CPU ms per step (means): bare {o['bare_cpu_ms_per_step']:.1f}; while streaming "
            + ", ".join(f"{k} {v:.1f}" for k, v in o["streaming_cpu_ms_per_step"].items()),
            f"decode process CPU per step while streaming / bare step CPU {o['cpu_ratio']:.3f}x",
            "CPU ms of the idle services per bare step: "
            + ", ".join(f"{k} {v:.1f}" for k, v in o["services_cpu_ms_per_bare_step"].items()),
        ]
    lines.append(f"load average before {result['loadavg_before']}, after {result['loadavg_after']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["batching", "overhead"], default=None)
    parser.add_argument(
        "--attention",
        choices=["auto", "mojo", "torch"],
        default="auto",
        help="attention backend of the services and of the in-process runs (default: auto)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, bare run and every service alike (default: %(default)s; unset, "
        "torch takes one per core in every service, and on a small shared CPU spinning OpenMP "
        "threads then fight each other and the gRPC work)",
    )
    parser.add_argument("--batching-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batching-requests", type=int, default=16)
    parser.add_argument("--batching-prompt", type=int, default=64)
    parser.add_argument("--batching-output", type=int, default=64)
    parser.add_argument("--batching-repeats", type=int, default=5, help="(sequential, concurrent)")
    parser.add_argument(
        "--overhead-dtype",
        choices=["auto", *sorted(DTYPES)],
        default="bfloat16",
        help="auto: probe both (batch-1 decode CPU time, interleaved) and serve the faster "
        "(default: %(default)s, measured on par with float32 on a 2-core Xeon, half the memory)",
    )
    parser.add_argument(
        "--probe-steps", type=int, default=12, help="--overhead-dtype auto: steps per dtype"
    )
    parser.add_argument("--overhead-prompt", type=int, default=128)
    parser.add_argument(
        "--overhead-output", type=int, default=16, help="output tokens per request (per round)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="overhead: rounds of (output - 1 bare decode steps, one request) (default: "
        "%(default)s; short rounds interleave the two sides finely against others' load)",
    )
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/mili/bench")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results")
    args = parser.parse_args()
    if args.overhead_output < 3:
        parser.error("--overhead-output must be >= 3 (CPU is counted from the 2nd token on)")

    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU",
        "torch": torch.__version__,
        "threads": args.threads,
        "attention": args.attention,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }
    if args.only in (None, "batching"):
        result["batching"] = measure_batching(args)
    if args.only in (None, "overhead"):
        result["overhead"] = measure_overhead(args)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
