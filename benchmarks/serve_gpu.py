"""`mili serve --device cuda` end to end on Qwen3-0.6B shapes: TTFT at concurrency 1, then
output tokens/s at higher concurrency, measured by `mili bench` at the client.

The model is the random-weight bf16 Qwen3-0.6B the other benchmarks share (--cache-dir; --preset
tiny: a 2-layer one, benchmarks/presets.py, for checks of this script on a CPU), served
with the demo tokenizer linked beside it (prompts are token ids < 256). One `mili serve` (one
tokenizer, prefill, decode and frontend; prefill and decode on the same GPU, so the KV goes
over cuda-ipc) serves every run, after --warmup requests that capture CUDA graphs and fill the
allocators:

  ttft        --ttft-requests (0: none) requests one at a time, --prompt-tokens (512) each,
              16 output tokens: TTFT p50/p90 (issue 15's target: p50 <= 30 ms on an H100/H200)
  throughput  --concurrency (64, 256) workers sharing 2x as many requests of --prompt-tokens
              + --output-tokens (128): output tokens/s, TTFT and ITL percentiles

Each line prints as its run finishes, followed by a breakdown of where the requests' time went
inside the services over that run, from their own Prometheus metrics (benchmarks/
service_metrics.py: mean prefill/decode batch, step and KV hand-off times, the frontend's queue
wait and TTFT, each with its count, and each process's CPU %); --json has it per run.

    python3 benchmarks/serve_gpu.py --json serve_gpu.json
    python3 benchmarks/serve_gpu.py --device cuda:0 --concurrency 1 --ttft-requests 100
    python3 benchmarks/serve_gpu.py --concurrency '' --overlap-steps off   # decode's steps
                                                                 # not overlapped, c=1 only
    python3 benchmarks/serve_gpu.py --frontends 4 --ttft-requests 0 --concurrency 256
    python3 benchmarks/serve_gpu.py --frontends 4 --ttft-requests 0 --concurrency 256 \
        --prefill-batch-tokens 8192                # prefill steps of up to 8192 tokens
    python3 benchmarks/serve_gpu.py --device cpu --preset tiny --ttft-requests 3 --warmup 1 \
        --concurrency 4 --output-tokens 16          # a check of this script on any machine
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.served, as a script

from benchmarks import service_metrics
from benchmarks.presets import CHOICES, DEFAULT_CACHE, preset_checkpoint
from benchmarks.served import (
    Served,
    bench_args,
    kernels_served,
    mili_serve,
    run_bench,
    servable,
)
from services.decode.config import OVERLAP_CHOICES

TTFT_TARGET_MS = 30.0


def _line(name: str, summary: dict[str, Any]) -> str:
    ttft, itl = summary["ttft"], summary["itl"]
    # The client's busiest process, % of one core: near 100, the run measured the client.
    client = max(summary["client_cpu_percent"])
    return (
        f"{name:<16} TTFT p50 {ttft['p50_ms']:7.1f} p90 {ttft['p90_ms']:7.1f} ms   "
        f"ITL p50 {itl['p50_ms']:6.2f} ms   {summary['output_tokens_per_s']:9.0f} output tok/s"
        f"   client {summary['config']['processes']} x <= {client:.0f}% CPU"
    )


def _measured(s: Served, name: str, ns: argparse.Namespace) -> dict[str, Any]:
    """`mili bench` with `ns`: its summary, printed with the services' breakdown of the run."""
    before = service_metrics.snapshot(s.metrics)
    summary = run_bench(ns)
    print(_line(name, summary), flush=True)
    try:
        after = service_metrics.snapshot(s.metrics)
        # CPU % over the run's own wall time: the client processes' start-up before it (a
        # second or two) is idle time of the services.
        summary["breakdown"] = service_metrics.breakdown(before, after, summary["wall_s"])
        print("\n".join(service_metrics.lines(summary["breakdown"])), flush=True)
    except Exception as e:  # the measured numbers above matter more
        print(f"  breakdown: - ({type(e).__name__}: {e})", flush=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3-0.6b", choices=CHOICES)
    parser.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "mojo", "torch"],
        help="mili serve's kernels; mojo: fail, not fall back to torch, when they are missing",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--ttft-requests", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--concurrency", default="64,256", help="comma-separated; '' skips")
    parser.add_argument("--output-tokens", type=int, default=128, help="per throughput request")
    parser.add_argument(
        "--overlap-steps",
        default="auto",
        choices=OVERLAP_CHOICES,
        help="decode's --overlap-steps (auto: on CUDA), to compare the two on one machine",
    )
    parser.add_argument(
        "--frontends",
        type=int,
        default=None,
        help="mili serve --frontends N, on one port; the clients' connections spread over them "
        "(default: mili serve's, with --device cuda one per 4 cores up to 4, else 1)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=4,
        help="mili bench --processes at each --concurrency level (the TTFT run has one "
        "client): one Python process reads only so many streamed tokens a second "
        '(docs/benchmarks.md, "mili bench\'s own CPU")',
    )
    parser.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=None,
        help="prefill's --max-batch-tokens (default: the service's): the tokens one prefill "
        "step takes, whose host work per step is mostly per layer, not per token",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = parser.parse_args()
    # SIGTERM (serve_profile.sh ends the run so; a piece's timeout) unwinds like an error, so
    # `mili_serve` drains and stops the server before we exit: the next piece needs the device.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    levels = [int(c) for c in args.concurrency.split(",") if c]
    max_running = max([256, *levels])

    started = time.perf_counter()
    print(f"model: random {args.preset} bf16 in {args.cache_dir} (written once)", flush=True)
    weights = preset_checkpoint(args.preset, args.cache_dir)
    extra = ["--device", args.device, "--fail-fast"]
    extra += [
        "--decode-args",
        f"--max-running {max_running} --overlap-steps {args.overlap_steps}",
    ]
    queued = max(8192, 128 * args.prompt_tokens, 4 * (args.prefill_batch_tokens or 0))
    prefill_args = f"--max-queued-tokens {queued}"
    if args.prefill_batch_tokens is not None:
        prefill_args += f" --max-batch-tokens {args.prefill_batch_tokens}"
    extra += ["--prefill-args", prefill_args]
    result: dict[str, Any] = {
        "device": args.device,
        "prompt_tokens": args.prompt_tokens,
        "prefill_batch_tokens": args.prefill_batch_tokens,
    }
    with (
        servable(weights) as model_dir,
        mili_serve(
            model_dir, "bfloat16", 4, args.attention, extra, metrics=True, frontends=args.frontends
        ) as s,
    ):
        print(f"serving on {s.address} after {time.perf_counter() - started:.0f} s", flush=True)
        print(f"prefill --max-batch-tokens: {args.prefill_batch_tokens or 'default'}")
        # Under --attention auto a kernel that failed its start-up self-check runs on torch:
        # these numbers are then torch's, and this line says so.
        result["kernels"] = kernels_served(s)
        print("kernels: " + "; ".join(f"{n} {k}" for n, k in result["kernels"].items()), flush=True)
        run_bench(bench_args(s.address, 1, args.warmup, args.prompt_tokens, 16, seed=99))
        # Each run its own prompts (its own seed): a run repeating an earlier one's would find
        # them in prefill's prefix cache and compute a block of each (runs 1-4 did: 23-25% of
        # the c=64 and c=256 prefill work was skipped).
        if args.ttft_requests:
            ttft = bench_args(s.address, 1, args.ttft_requests, args.prompt_tokens, 16, seed=1)
            result["ttft"] = _measured(s, "concurrency 1", ttft)
        for level in levels:
            bench = bench_args(
                s.address, level, 2 * level, args.prompt_tokens, args.output_tokens,
                seed=1000 + level, processes=args.client_processes,
            )  # fmt: skip
            result[f"concurrency_{level}"] = _measured(s, f"concurrency {level}", bench)
    if "ttft" in result:
        p50 = result["ttft"]["ttft"]["p50_ms"]
        line = f"TTFT p50 at concurrency 1, {args.prompt_tokens}-token prompts: {p50:.1f} ms"
        if args.device.startswith("cuda"):  # the target is an H100/H200 one
            met = "met" if p50 <= TTFT_TARGET_MS else "NOT met"
            line += f" (target <= {TTFT_TARGET_MS:.0f} ms: {met})"
        print(line, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
