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
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from mili.client import bench as client
from mili.client import bench_clients
from mili.client.bench_report import percentile
from mili.engine.generate import generate
from mili.engine.model.checkpoint import cached_random_checkpoint
from mili.engine.model.config import PRESETS
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model as _load_weights
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch, Qwen3ForCausalLM
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.sampler import Sampler, SequenceSampling
from mili.serve.child import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen3-0.6b"
BLOCK_SIZE = 16
TOKEN_ID_RANGE = "0:256"  # byte tokens: inside the demo tokenizer's vocabulary (and Qwen3's)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


# ---- models ----------------------------------------------------------------------------------


def checkpoint_dir(cache_dir: Path) -> Path:
    """The bf16 Qwen3-0.6B checkpoint (seed 0), written once (shared with the other benchmarks)."""
    return cached_random_checkpoint(PRESETS[MODEL], MODEL, cache_dir)


def demo_dir() -> Path:
    from mili.demo.model import default_model_dir

    return default_model_dir()


@contextlib.contextmanager
def servable(weights: Path) -> Iterator[Path]:
    """`weights` (config + safetensors, no tokenizer) plus the demo tokenizer, as one model dir.

    Symlinks in a temporary directory: the tokenizer service needs tokenizer.json, and any
    byte-level tokenizer does for token-id prompts (ids it does not know are left out of text).
    """
    tokenizer = demo_dir()
    with tempfile.TemporaryDirectory(prefix="mili-serving-") as tmp:
        model_dir = Path(tmp) / weights.name
        model_dir.mkdir()
        for path in weights.iterdir():
            if path.name not in TOKENIZER_FILES:
                (model_dir / path.name).symlink_to(path)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).exists():
                (model_dir / name).symlink_to(tokenizer / name)
        yield model_dir


def load_model(path: Path, *, dtype: torch.dtype, attention: str) -> Any:
    """The checkpoint with the attention backend and fused ops `mili serve --attention` runs:
    the in-process (bare, engine) runs then compare like with like."""
    from kernels.backend import select_attention, select_fused_ops

    model = _load_weights(path, dtype=dtype)
    head_dim = model.config.head_dim
    model.attention = select_attention(attention, "cpu", head_dim=head_dim)
    model.fused_ops = select_fused_ops(attention, "cpu", head_dim=head_dim)
    return model


# ---- mili serve ------------------------------------------------------------------------------


@dataclass
class Served:
    address: str
    proc: subprocess.Popen[str]
    log: TextIO
    metrics: dict[str, str] = field(default_factory=dict)  # child name -> its /metrics URL
    children: dict[str, str] = field(default_factory=dict)  # child name -> its gRPC address

    @property
    def cpu(self) -> CpuMeter:
        return CpuMeter(self.proc.pid)


def kernels_served(served: Served) -> dict[str, str]:
    """What each prefill and decode instance of `served` runs, from its Info: "attention X,
    fused ops Y, N CUDA graphs" (with --attention auto, "torch" where a Mojo kernel failed its
    start-up self-check; N: the step's captured sizes, 0 eager), or "-" with the status when it
    did not answer."""
    import grpc

    from mili.pb.decode.v1 import decode_pb2, decode_pb2_grpc
    from mili.pb.prefill.v1 import prefill_pb2, prefill_pb2_grpc

    stubs: dict[str, tuple[Any, Any]] = {  # kind -> (its stub class, its InfoRequest)
        "prefill": (prefill_pb2_grpc.PrefillServiceStub, prefill_pb2.InfoRequest()),
        "decode": (decode_pb2_grpc.DecodeServiceStub, decode_pb2.InfoRequest()),
    }
    found = {}
    for name, address in sorted(served.children.items()):
        kind = name.split("-")[0]
        if kind not in stubs:
            continue
        stub, request = stubs[kind]
        try:
            with grpc.insecure_channel(address) as channel:
                info = stub(channel).Info(request, timeout=10)
            found[name] = (
                f"attention {info.attention_backend}, fused ops {info.fused_ops}, "
                f"{info.num_cuda_graphs} CUDA graphs"
            )
        except grpc.RpcError as e:
            found[name] = f"- ({e.code().name})"
    return found


def _cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def services(launcher: int) -> dict[str, int]:
    """{"tokenizer": pid, "prefill": pid, ...}: the children of `mili serve` (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if ppid == launcher:
                kind = next(a.decode() for a in argv if a.startswith(b"serve-"))
                found[kind.removeprefix("serve-")] = int(entry.name)
    return dict(sorted(found.items()))


class CpuMeter:
    """CPU seconds each service of one `mili serve`, and this (client) process, spend."""

    def __init__(self, launcher: int) -> None:
        self.pids = services(launcher)

    def _now(self) -> dict[str, float]:
        now = {name: _cpu_s(pid) for name, pid in self.pids.items()}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return now | {"client": usage.ru_utime + usage.ru_stime}

    @contextlib.contextmanager
    def measure(self, out: dict[str, float]) -> Iterator[None]:
        before = self._now()
        yield
        after = self._now()
        for name, value in after.items():
            out[name] = out.get(name, 0.0) + value - before[name]


def thread_env(threads: int) -> dict[str, str]:
    n = str(threads)
    return {**os.environ, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


@contextlib.contextmanager
def mili_serve(
    model_dir: Path,
    dtype: str,
    threads: int,
    attention: str,
    extra: list[str],
    *,
    metrics: bool = False,
    frontends: int | None = 1,
    tree: Path = ROOT,
) -> Iterator[Served]:
    """`mili serve` on free ports; yields once the frontends are listening; drains it on exit.

    tree: the source tree it runs from (its working directory and PYTHONPATH; another checkout
    to measure a change side by side).

    metrics: every child serves Prometheus metrics on a free port (--metrics-port 0), their
    URLs in Served.metrics, read from the launcher's summary lines on stdout.
    frontends: `mili serve --frontends`, all on Served.address (`mili bench`'s clients, one
    connection each, spread over them); None: mili serve's default for the device.
    """
    command = [sys.executable, "-m", "mili", "serve", "--model", str(model_dir), "--port", "0"]
    command += ["--attention", attention, "--http-port", "0"]
    command += [] if frontends is None else ["--frontends", str(frontends)]
    command += ["--dtype", dtype, "--log-level", "WARNING", *extra]
    if metrics:
        command += ["--metrics-port", "0"]
    with tempfile.TemporaryFile("w+") as log:  # children's logs: shown only if start-up fails
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=tree,
            env={**thread_env(threads), "PYTHONPATH": str(tree)},
            # a benchmark killed (a piece's timeout) must not leave `mili serve` holding the
            # device's memory and ports for the next piece: it drains and stops with us
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        try:
            assert proc.stdout is not None
            address = None
            urls = {}
            children = {}
            for line in proc.stdout:
                if line.startswith("frontend service listening on "):
                    address = line.split()[-1]
                    break
                # `mili serve: <name> <address> pid N [http URL] [metrics URL]`
                words = line.split()
                if words[:2] == ["mili", "serve:"] and words[4:5] == ["pid"]:
                    children[words[2]] = words[3]
                    if "metrics" in words[3:-1]:
                        urls[words[2]] = words[words.index("metrics", 3) + 1]
            if address is None:
                log.seek(0)
                tail = "".join(log.readlines()[-30:])
                raise RuntimeError(f"mili serve in {tree} exited {proc.wait()}:\n{tail}")
            yield Served(address, proc, log, urls, children)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_args(
    address: str,
    concurrency: int,
    num_requests: int,
    prompt: int,
    output: int,
    seed: int = 0,
    processes: int = 1,
) -> argparse.Namespace:
    return argparse.Namespace(
        address=address,
        concurrency=concurrency,
        num_requests=num_requests,
        connections=None,  # one per client, at most 64: several frontends behind one port
        processes=processes,  # client processes (mili bench --processes)
        prompt_tokens=prompt,
        output_tokens=output,
        token_id_range=TOKEN_ID_RANGE,
        seed=seed,
        timeout=600.0,
        max_retries=0,  # a measurement: a refused request is an error, not a retry
    )


def run_bench(ns: argparse.Namespace) -> dict[str, Any]:
    summary = asyncio.run(client.bench(ns))
    if summary["num_errors"]:
        raise RuntimeError(f"requests failed: {summary['errors']}")
    return summary


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


class BareDecode:
    """One sequence on the bare model, batch 1: `prompt` prefilled, then decode steps on demand.

    A step is what the decode service's batch thread does per step besides its bookkeeping:
    DecodeBatch.build + model.decode + Sampler (greedy), feeding back the sampled token.
    """

    def __init__(self, model: Qwen3ForCausalLM, prompt: list[int], max_steps: int) -> None:
        self.model, self.prompt = model, prompt
        num_blocks = -(-(len(prompt) + max_steps + 1) // BLOCK_SIZE)
        self.cache = KVCache(model.config, num_blocks, BLOCK_SIZE, dtype=model.dtype)
        self.table = list(range(num_blocks))
        params = SamplingParams(temperature=0.0, max_tokens=max_steps + 1, ignore_eos=True)
        self.sampling = SequenceSampling(params, prompt, model.config.vocab_size)
        self.sampler = Sampler()
        with torch.inference_mode():
            batch = PrefillBatch.build([prompt], [self.table], BLOCK_SIZE)
            logits = model.prefill(batch, self.cache)
            self.sampling.append(self.sampler(logits, [self.sampling]).token_ids[0])

    @torch.inference_mode()
    def step(self, cpu_clock: Callable[[], float]) -> tuple[float, float, float]:
        """(model.decode s, whole step s, whole step CPU s)."""
        cpu_start, start = cpu_clock(), time.perf_counter()
        position = len(self.prompt) + len(self.sampling.output_token_ids) - 1
        token = self.sampling.output_token_ids[-1]
        batch = DecodeBatch.build([token], [position], [self.table], BLOCK_SIZE)
        t0 = time.perf_counter()
        logits = self.model.decode(batch, self.cache)
        t1 = time.perf_counter()
        self.sampling.append(self.sampler(logits, [self.sampling]).token_ids[0])
        return t1 - t0, time.perf_counter() - start, cpu_clock() - cpu_start


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
