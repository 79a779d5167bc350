"""The engine on one device: decode TPOT eager vs CUDA graphs, prefill tokens/s, kernel launches
per decode step, and HF transformers' `generate` on the same weights, all in one run.

    python benchmarks/engine_gpu.py                                  # GPU: Qwen3-0.6B shapes
    python benchmarks/engine_gpu.py --device cpu --preset tiny       # CPU check, small shapes

Weights: random, `--preset`'s shapes (qwen3-0.6b: 28 layers, hidden 1024, vocab 151936), written
once as a bf16 checkpoint by mili.engine.checkpoint.cached_random_checkpoint into --cache-dir
(the one the other benchmarks share); `tiny` (benchmarks/presets.py) is 2 layers of hidden 64,
4 q / 2 kv heads of 64 (the Mojo kernels' smallest head_dim), vocab 896; `tiny-moe` the same
with 8 experts of 32, 2 active.

--random-on-device makes the weights on the device instead (benchmarks.presets.random_model:
no checkpoint, nothing written, no HF comparison): how the MoE presets run, whose checkpoints
would be 61 GB (qwen3-30b-a3b) and 470 GB. Before building, the weights plus the KV blocks
the run needs are checked against the device's free memory; --layers N keeps the preset's
first N layers where the whole model would not fit (every per-layer cost then scales by
layers / N: the run prints that upper estimate beside what it measured). Qwen3-30B-A3B on one
H100 (80 GB): 56.8 GiB of bf16 weights + 96 KiB of KV per token, all 48 layers fit at batch 64
and context 1024 (6.2 GiB of KV). The issue 32 comparison, printed with the table:

    python3 benchmarks/engine_gpu.py --preset qwen3-30b-a3b --random-on-device --no-hf \
        --batches 1,10,64 --context 1024                   # vLLM: 13.2 ms TPOT at c=10

Kernels: --attention picks the attention backend and, as in `mili serve` (one flag, one kernel
family), the fused elementwise ops too; --fused overrides the latter (torch: the reference ops).

decode   B sequences of --context prompt tokens each (prefilled first), then --steps decode
         steps through ModelRunner.decode (static inputs, sampling on the device, the ids'
         copy back: what decode's batch thread runs), greedy; TPOT = median step wall time.
         Modes: eager, and graphs (CUDA only, graph-safe attention and fused ops; `--attention
         torch-graphs` marks the torch reference graph-safe: correct over full-width block
         tables, slow since it gathers all of them, so it measures the graph machinery only).
         Then "ahead" (decode's --overlap-steps, CUDA's default): the best mode's steps, each
         forward launched before the previous step's ids reach the host, its sampling after
         (ModelRunner.decode_logits' `ahead`),
         TPOT = wall time of --steps such steps / --steps (one step's time alone means little
         when they overlap).
launches kernels launched per decode step, from one step under torch.profiler: CUDA runtime
         and driver launch calls (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch ...); on
         CPU the aten ops a step runs instead. On CUDA the same step's GPU kernel time too
         (the profiler's device time of its kernels): wall / kernel time is how much of a step
         the host adds (issue 33's goal: <= 1.2x at batch 1).
prefill  --prefill-batch prompts of --prefill-tokens tokens in one ModelRunner.prefill;
         tokens/s = prompt tokens / median wall time. On CUDA (dense models) also 1 prompt,
         then both again replayed from the prefill service's graphs (capture_prefill_graphs).
hf       transformers.Qwen3ForCausalLM (sdpa attention) `generate` on the same checkpoint and
         dtype, greedy, batch B of the same prompts: TPOT = (time of --steps + 1 new tokens -
         time of 1) / --steps, so its prefill is left out.

Prints each measurement as it finishes (a run cut off by a time limit still reports what it
measured), then one table (and --json writes the rows); the numbers belong in
docs/benchmarks.md with the date, machine and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.presets import (
    CHOICES,
    DEFAULT_CACHE,
    preset_checkpoint,
    preset_config,
    random_model,
)
from kernels.backend import select_fused_ops
from kernels.choice import select_kernels
from kernels.self_check import CheckShape
from mili.engine.kv.block_pool import BlockPool, blocks_needed
from mili.engine.model import grouped_gemm
from mili.engine.model.attention import TorchAttention
from mili.engine.model.config import Qwen3Config
from mili.engine.model.kv_cache import bytes_per_block
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import Qwen3ForCausalLM
from mili.engine.model.sizing import num_active_parameters, weight_bytes
from mili.engine.sampling_params import SamplingParams
from mili.engine.step.ahead_check import check_ahead
from mili.engine.step.runner import Launched, ModelRunner
from mili.engine.step.sequence import Sequence

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAUNCH_KEYS = ("LaunchKernel", "GraphLaunch", "cuLaunch", "LaunchCooperativeKernel")
# Published numbers the table is read against, per preset (printed under it).
REFERENCES = {
    "qwen3-0.6b": "issue 33's goals (H100): batch 1 <= 1.5 ms with graphs, >= 20k tok/s at 256; "
    "vLLM published TPOT 2.39 ms at light load",
    "qwen3-30b-a3b": "vLLM published (one H100, untuned): TPOT 13.2 ms, 739.8 output tok/s at "
    "concurrency 10, 2048 in / 1024 out (serving end to end; this is the engine alone)",
}
TOP_KERNELS = 12  # kernels (aten ops on the CPU) listed for the batch-1 step
FORWARD_REPEATS = 5  # decode forwards timed with CUDA events per batch (forward_device_ms)


class _GraphSafeTorch(TorchAttention):
    """The torch reference declared graph-safe (see the module docstring: `torch-graphs`)."""

    name = "torch-graphs"
    is_graph_safe = True


@dataclass
class Row:
    batch: int
    eager_tpot_ms: float | None = None
    graphs_tpot_ms: float | None = None
    ahead_tpot_ms: float | None = None  # the best of the two, steps launched ahead
    hf_tpot_ms: float | None = None
    eager_launches: int | None = None
    graphs_launches: int | None = None
    # GPU kernel time of one step (CUDA only): wall / this says how much of a step is host
    eager_gpu_ms: float | None = None
    graphs_gpu_ms: float | None = None

    @property
    def best_tpot_ms(self) -> float | None:
        modes = (self.eager_tpot_ms, self.graphs_tpot_ms, self.ahead_tpot_ms)
        return min((x for x in modes if x), default=None)

    def cells(self) -> list[str]:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"

        def tok_s(x: float | None) -> str:
            return "-" if x is None else f"{self.batch / x * 1e3:.0f}"

        def n(x: int | None) -> str:
            return "-" if x is None else str(x)

        return [
            str(self.batch),
            ms(self.eager_tpot_ms),
            ms(self.graphs_tpot_ms),
            ms(self.ahead_tpot_ms),
            ms(self.hf_tpot_ms),
            tok_s(self.best_tpot_ms),
            tok_s(self.hf_tpot_ms),
            n(self.eager_launches),
            n(self.graphs_launches),
        ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=g).tolist()


def start(runner: ModelRunner, pool: BlockPool, ids: list[list[int]], steps: int) -> list[Sequence]:
    """Prefill `ids` (in chunks of at most 8192 tokens), first tokens sampled; every sequence
    holds the blocks of all its tokens."""
    vocab_size = runner.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    seqs = []
    for prompt in ids:
        s = Sequence.new(prompt, params, vocab_size=vocab_size, eos_token_ids=[])
        s.block_table = pool.allocate(blocks_needed(len(prompt) + steps + 1, runner.block_size))
        seqs.append(s)
    per_call = max(1, 8192 // len(ids[0]))
    for i in range(0, len(seqs), per_call):
        part = seqs[i : i + per_call]
        logits = runner.prefill(
            [s.prompt_token_ids for s in part], [s.block_table for s in part], [0] * len(part)
        )
        out = runner.sample(logits, [s.sampling for s in part]).result()
        for s, t in zip(part, out.token_ids, strict=True):
            s.append(t)
    return seqs


def step(runner: ModelRunner, seqs: list[Sequence]) -> None:
    out = runner.decode(seqs).result()
    for s, t in zip(seqs, out.token_ids, strict=True):
        s.append(t)


def decode_batch(
    runner: ModelRunner, batch: int, args: argparse.Namespace
) -> tuple[BlockPool, list[Sequence]]:
    """`batch` prefilled sequences of --context prompt tokens, each with room for the warm-up
    and timed steps, and the pool they hold blocks of."""
    pool = BlockPool(runner.num_blocks, null_block=True)
    seqs = start(
        runner,
        pool,
        prompts(batch, args.context, runner.model.config.vocab_size),
        args.warmup + args.steps + 1 + FORWARD_REPEATS,
    )
    return pool, seqs


def forward_device_ms(runner: ModelRunner, seqs: list[Sequence]) -> float:
    """Median device time of the decode forward alone over FORWARD_REPEATS steps: CUDA events
    recorded around `decode_logits` (a graph replay is launched at once, so this is what the
    device spends on it, gaps between its kernels included). Kept beside the profiler's kernel
    sum, which may record nothing once graphs were captured."""
    times = []
    for _ in range(FORWARD_REPEATS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            begin.record()
            logits = runner.decode_logits(seqs)
            end.record()
            out = runner.sample(logits, [s.sampling for s in seqs]).result()
        for s, t in zip(seqs, out.token_ids, strict=True):
            s.append(t)
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def ahead_tpot(runner: ModelRunner, batch: int, args: argparse.Namespace) -> float:
    """Decode steps at `batch`, each launched before the previous one's ids are appended (as
    decode's batch thread overlaps them): ms per step over --steps of them."""
    device = runner.device
    pool, seqs = decode_batch(runner, batch, args)

    def steps(n: int) -> None:
        pending = Launched(seqs, runner.decode(seqs))
        for _ in range(n - 1):
            with torch.inference_mode():
                logits = runner.decode_logits(seqs, ahead=pending)  # the forward first
            collect(pending)
            pending = Launched(seqs, runner.sample(logits, [s.sampling for s in seqs]))
        collect(pending)

    def collect(launched: Launched) -> None:
        for s, t in zip(launched.seqs, launched.sample.result().token_ids, strict=True):
            s.append(t)

    steps(args.warmup)
    sync(device)
    t0 = time.perf_counter()
    steps(args.steps)  # ends with the last ids on the host
    elapsed = time.perf_counter() - t0
    for s in seqs:
        pool.free(s.block_table)
    return elapsed / args.steps * 1e3


class Profiled(NamedTuple):
    launches: int  # kernel launches (aten ops on the CPU)
    gpu_ms: float | None  # GPU kernel time; None on the CPU or where none was recorded
    top: list[tuple[str, int, float]]  # (kernel or aten op, calls, us), costliest first


def profile_step(fn: Callable[[], None], device: torch.device) -> Profiled:
    """One call of `fn` under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    if device.type != "cuda":
        ops = [e for e in events if e.key.startswith("aten::")]
        top = [(e.key, e.count, e.self_cpu_time_total) for e in ops]
        return Profiled(sum(e.count for e in ops), None, sorted(top, key=lambda t: -t[2]))
    launches = sum(e.count for e in events if any(k in e.key for k in LAUNCH_KEYS))
    # Kernels only: the copies and memsets the profiler also records on the device are not
    # what a step's kernels take. None when it recorded no kernel at all (a profiler session
    # before a graph capture has been reported to leave none after it): "n/a", never "0 ms".
    kernels = [
        (e.key, e.count, getattr(e, "self_device_time_total", 0.0))
        for e in events
        if getattr(e, "device_type", None) == DeviceType.CUDA
        and not e.key.startswith(("Memcpy", "Memset"))
    ]
    kernel_us = sum(us for _, _, us in kernels)
    top = sorted(kernels, key=lambda t: -t[2])
    return Profiled(launches, kernel_us / 1e3 if kernel_us > 0 else None, top)


def print_top(mode: str, batch: int, profiled: Profiled, n: int = TOP_KERNELS) -> None:
    """The step's costliest kernels (aten ops on the CPU): where a batch-1 step goes."""
    total = sum(us for _, _, us in profiled.top) or 1.0
    for name, calls, us in profiled.top[:n]:
        print(
            f"  {mode} batch {batch} top: {us:9.1f} us {100 * us / total:5.1f}% "
            f"{calls:4}x  {name[:90]}",
            flush=True,
        )


def decode_tpot(
    runner: ModelRunner, batch: int, args: argparse.Namespace
) -> tuple[float, int, float | None]:
    """Median decode step (ms) at `batch`, launches and GPU kernel ms in one step."""
    device = runner.device
    pool, seqs = decode_batch(runner, batch, args)
    for _ in range(args.warmup):
        step(runner, seqs)
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        step(runner, seqs)  # ends with the ids on the host: the step's one wait
        times.append(time.perf_counter() - t0)
    mode = "graphs" if runner.graphs is not None else "eager"
    profiled = profile_step(lambda: step(runner, seqs), device)
    if batch == 1:  # issue 33's 1.5 ms row
        print_top(mode, batch, profiled)
    if device.type == "cuda":
        print(
            f"  {mode} batch {batch} forward on the device: "
            f"{forward_device_ms(runner, seqs):.3f} ms (CUDA events around decode_logits)",
            flush=True,
        )
    for s in seqs:
        pool.free(s.block_table)
    return statistics.median(times) * 1e3, profiled.launches, profiled.gpu_ms


def prefill_tokens_per_s(
    runner: ModelRunner, args: argparse.Namespace, batch: int, *, step: bool = False
) -> float:
    """Prompt tokens/s of `batch` prompts of --prefill-tokens in one forward: runner.prefill
    (eager), or with `step` runner.prefill_step (a prefill graph's replay where it holds one)."""
    device = runner.device
    pool = BlockPool(runner.num_blocks, null_block=True)
    ids = prompts(batch, args.prefill_tokens, runner.model.config.vocab_size, 1)
    tables = [pool.allocate(blocks_needed(len(p), runner.block_size)) for p in ids]
    times = []
    with torch.inference_mode():
        for i in range(args.warmup + args.repeats):
            sync(device)
            t0 = time.perf_counter()
            if step:
                runner.prefill_step(ids, tables, [0] * len(ids))
            else:
                runner.prefill(ids, tables, [0] * len(ids))
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    for t in tables:
        pool.free(t)
    return batch * args.prefill_tokens / statistics.median(times)


def hf_tpot(
    path: Path, dtype: torch.dtype, device: torch.device, batch: int, args: argparse.Namespace
) -> float | None:
    try:
        import transformers
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        model = (
            transformers.Qwen3ForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa"
            )
            .to(device)  # type: ignore[arg-type]  # transformers' stubs want a dtype
            .eval()
        )
    ids = torch.tensor(prompts(batch, args.context, model.config.vocab_size), device=device)

    def run(new: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    one = statistics.median(run(1) for _ in range(args.repeats))
    many = statistics.median(run(args.steps + 1) for _ in range(args.repeats))
    return (many - one) / args.steps * 1e3


def run_config(args: argparse.Namespace) -> Qwen3Config:
    """The preset, or its first --layers layers."""
    config = preset_config(args.preset)
    if args.layers is None:
        return config
    if not 0 < args.layers <= config.num_hidden_layers:
        raise SystemExit(f"--layers must be 1..{config.num_hidden_layers} for {args.preset}")
    return dataclasses.replace(config, num_hidden_layers=args.layers)


def check_fits(config: Qwen3Config, num_blocks: int, args: argparse.Namespace) -> str:
    """Weights + KV blocks against the device's free memory (CUDA): a line to print, or exit
    naming what would fit, before a minute of allocating."""
    dtype = DTYPES[args.dtype]
    weights = weight_bytes(config, torch.empty((), dtype=dtype).element_size())
    kv = num_blocks * bytes_per_block(config, args.block_size, dtype)
    line = (
        f"weights {weights / 2**30:.3g} GiB ({num_active_parameters(config) / 1e9:.3g}B params "
        f"active per token), KV {kv / 2**30:.3g} GiB ({num_blocks} blocks)"
    )
    if args.device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(args.device))
        line += f", device free {free / 2**30:.1f} of {total / 2**30:.1f} GiB"
        headroom = 2 << 30  # activations of a prefill chunk, graph pools, the allocator's slack
        if weights + kv + headroom > free:
            per_layer = (weights + kv) / config.num_hidden_layers
            fits = int((free - headroom) // per_layer)
            raise SystemExit(f"does not fit: {line}; try --layers {max(1, fits)} or a smaller run")
    return line


def load(path: Path | None, args: argparse.Namespace) -> Qwen3ForCausalLM:
    device = torch.device(args.device)
    if path is None:
        model = random_model(run_config(args), device, DTYPES[args.dtype])
    else:
        model = load_model(path, device=device, dtype=DTYPES[args.dtype])
    head_dim = model.config.head_dim
    if args.attention == "torch-graphs":
        model.attention = _GraphSafeTorch()
    elif args.attention == "torch":
        model.attention = TorchAttention()
    else:
        # As the services pick them: a Mojo kernel that loads but fails its start-up
        # self-check (a fault on this device) runs on torch under auto, not down the run.
        dtype_name = str(DTYPES[args.dtype]).removeprefix("torch.")
        shape = CheckShape.of(model.config, args.block_size, dtype_name)
        kernels = select_kernels(args.attention, args.device, shape)
        for fault in kernels.faults:
            print(f"kernel self-check FAILED (the header says what runs): {fault}", flush=True)
        model.attention, model.fused_ops = kernels.attention, kernels.fused_ops
    if args.fused is not None or args.attention in ("torch", "torch-graphs"):
        fused = args.fused or "torch"
        model.fused_ops = select_fused_ops(fused, device, head_dim=head_dim)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3-0.6b", choices=CHOICES)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument(
        "--attention", default="auto", choices=["auto", "mojo", "torch", "torch-graphs"]
    )
    parser.add_argument(
        "--fused",
        default=None,
        choices=["auto", "mojo", "torch"],
        help="fused elementwise ops (default: as --attention, what mili serve runs)",
    )
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument(
        "--random-on-device",
        action="store_true",
        help="random weights made on the device, no checkpoint (MoE presets; no HF)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="the preset's first N layers (--random-on-device)"
    )
    parser.add_argument(
        "--overlap-launches",
        action="store_true",
        help="launch the Mojo GPU kernels with programmatic stream serialization (each may start "
        "while the previous kernel finishes; kernels/cuda_driver.py)",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    if args.layers is not None and not args.random_on_device:
        parser.error("--layers needs --random-on-device (a checkpoint has all its layers)")
    tokens = args.context + args.warmup + args.steps + 2
    num_blocks = max(batches) * blocks_needed(tokens, args.block_size)
    num_blocks = max(num_blocks, args.prefill_batch * blocks_needed(args.prefill_tokens, 16))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    full_layers = preset_config(args.preset).num_hidden_layers
    config = run_config(args)
    if args.random_on_device:
        print(f"# {check_fits(config, num_blocks, args)}", flush=True)
        path = None
    else:
        path = preset_checkpoint(args.preset, args.cache_dir)
    t0 = time.perf_counter()
    model = load(path, args)
    sync(device)
    # A kernel a family runs without after failing the self-check (kernels/choice.py).
    no_split = "" if getattr(model.attention, "split_decode", True) else " without split decode"
    no_gemv = "" if getattr(model.fused_ops, "gemv", True) else " without gemv"
    overlapped = ""
    if args.overlap_launches:
        kernels = [k for k in (model.attention, model.fused_ops) if hasattr(k, "overlap_launches")]
        for k in kernels:
            k.overlap_launches = True
        overlapped = f", overlapped launches ({len(kernels)} kernel families)"
    weights = "random on the device" if path is None else "checkpoint"
    experts = ""
    if config.is_moe:
        widths = (config.hidden_size, config.moe_intermediate_size)
        gemm = grouped_gemm.default_grouped_gemm(device, DTYPES[args.dtype], widths)
        experts = f", {config.num_experts} experts ({config.num_experts_per_tok} active, {gemm})"
    print(
        f"# {args.preset} {args.dtype} on {args.device} ({name}), torch {torch.__version__}, "
        f"{config.num_hidden_layers} of {full_layers} layers{experts}, weights {weights} "
        f"({time.perf_counter() - t0:.1f} s), attention {model.attention.name}{no_split}, "
        f"fused ops {model.fused_ops.name}{no_gemv}{overlapped}, context {args.context}, "
        f"{args.steps} steps",
        flush=True,
    )
    what = "launches" if device.type == "cuda" else "aten ops"
    eager = ModelRunner.create(model, num_blocks, args.block_size, max_decode_batch=max(batches))
    prefill = prefill_tokens_per_s(eager, args, args.prefill_batch)
    print(
        f"prefill: {args.prefill_batch} x {args.prefill_tokens} tokens: {prefill:.0f} tok/s",
        flush=True,
    )
    prefill_graphs = None
    # The prefill service's graphs (prefill_graphs.py), on the same runner; not for the MoE
    # preset, whose checkpoint leaves the card little room for another memory pool.
    if device.type == "cuda" and not config.is_moe:
        one = prefill_tokens_per_s(eager, args, 1)
        print(f"prefill: 1 x {args.prefill_tokens} tokens: {one:.0f} tok/s", flush=True)
        if eager.capture_prefill_graphs(args.prefill_batch * args.prefill_tokens):
            prefill_graphs = {
                b: prefill_tokens_per_s(eager, args, b, step=True)
                for b in sorted({1, args.prefill_batch})
            }
            for b, rate in prefill_graphs.items():
                print(
                    f"prefill graphs: {b} x {args.prefill_tokens} tokens: {rate:.0f} tok/s",
                    flush=True,
                )
        else:
            print("prefill graphs: off (the warning above says why)", flush=True)
    rows = [Row(b) for b in batches]

    def report(
        mode: str,
        row: Row,
        tpot_ms: float | None,
        launches: int | None = None,
        gpu_ms: float | None = None,
    ) -> None:
        if tpot_ms is None:
            print(f"{mode:6} batch {row.batch:4}: n/a", flush=True)
            return
        counted = "" if launches is None else f", {launches} {what}/step"
        if gpu_ms:
            counted += f", GPU kernels {gpu_ms:.2f} ms/step (wall {tpot_ms / gpu_ms:.2f}x)"
        elif launches is not None and device.type == "cuda":
            counted += ", GPU kernels n/a (the profiler recorded none)"
        print(
            f"{mode:6} batch {row.batch:4}: TPOT {tpot_ms:8.2f} ms, "
            f"{row.batch / tpot_ms * 1e3:8.0f} tok/s{counted}",
            flush=True,
        )

    for row in rows:
        row.eager_tpot_ms, row.eager_launches, row.eager_gpu_ms = decode_tpot(
            eager, row.batch, args
        )
        report("eager", row, row.eager_tpot_ms, row.eager_launches, row.eager_gpu_ms)
    best = eager  # the mode the "ahead" steps run in: graphs where they capture
    note = ""
    if device.type != "cuda":
        note = "graphs: n/a on CPU"
    elif not getattr(model.attention, "is_graph_safe", False):
        note = f"graphs: n/a, attention {model.attention.name} is not graph-safe"
    elif not model.fused_ops.is_graph_safe:
        note = f"graphs: n/a, fused ops {model.fused_ops.name} are not graph-safe"
    elif config.is_moe and not grouped_gemm.is_graph_safe(
        device, model.dtype, (config.hidden_size, config.moe_intermediate_size)
    ):
        note = f"graphs: n/a, the experts' grouped GEMM is not graph-safe in {args.dtype} here"
    else:
        del eager, best
        graphs = ModelRunner.create(
            model, num_blocks, args.block_size, max_decode_batch=max(batches)
        )
        t0 = time.perf_counter()
        graphs.capture_graphs()
        assert graphs.graphs is not None
        note = (
            f"graphs: {len(graphs.graphs.batch_sizes)} captured in "
            f"{time.perf_counter() - t0:.1f} s, "
            f"{graphs.graphs.memory_bytes / 2**20:.0f} MiB"
        )
        print(note, flush=True)
        for row in rows:
            row.graphs_tpot_ms, row.graphs_launches, row.graphs_gpu_ms = decode_tpot(
                graphs, row.batch, args
            )
            report("graphs", row, row.graphs_tpot_ms, row.graphs_launches, row.graphs_gpu_ms)
        best = graphs
    why = check_ahead(best)  # decode's start-up check: overlap only where it passes
    print(f"ahead: start-up check {'passed' if why is None else 'FAILED: ' + why}", flush=True)
    for row in rows:
        row.ahead_tpot_ms = ahead_tpot(best, row.batch, args)
        report("ahead", row, row.ahead_tpot_ms)
    del best
    if path is None:
        print("# hf: n/a, no checkpoint (--random-on-device)", flush=True)
    elif not args.no_hf:
        del model
        for row in rows:
            row.hf_tpot_ms = hf_tpot(path, DTYPES[args.dtype], device, row.batch, args)
            report("hf", row, row.hf_tpot_ms)

    print(f"# {note}")
    header = [
        "batch",
        "eager TPOT ms",
        "graphs TPOT ms",
        "ahead TPOT ms",
        "HF TPOT ms",
        "tok/s (best)",
        "HF tok/s",
        f"eager {what}/step",
        f"graphs {what}/step",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row.cells()) + " |")
    if config.num_hidden_layers < full_layers:
        scale = full_layers / config.num_hidden_layers
        for row in rows:
            if (tpot := row.best_tpot_ms) is not None:
                print(
                    f"# batch {row.batch}: {full_layers} layers <= {tpot * scale:.2f} ms TPOT "
                    f"(x {scale:.2f}: every cost counted per layer, the head's too)"
                )
    if args.preset in REFERENCES:
        print(f"# compare: {REFERENCES[args.preset]}")
    if args.json:
        result: dict[str, Any] = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "device_name": name,
            "layers": config.num_hidden_layers,
            "prefill_tokens_per_s": prefill,
            "prefill_graph_tokens_per_s": prefill_graphs,
            "note": note,
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
