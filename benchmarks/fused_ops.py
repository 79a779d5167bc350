"""Fused elementwise ops (Mojo kernels) against their torch reference, then a whole decode step
with each, side by side in one run, on the CPU or (--device cuda) a GPU.

Ops at Qwen3-0.6B's shapes (hidden 1024, 16 q / 8 kv heads, D=128, intermediate 3072) for T
tokens: T=1 and 16 (decode steps), 512 (a prefill chunk). Each row alternates Mojo and the
reference (mili.engine.fused_ops.TorchFusedOps) for --repeats rounds and reports the best of each
and their ratio; --compile adds `torch.compile` of the reference as a third column.

Decode step: a random-weight model with Qwen3-0.6B's layer shapes (--layers of them, a small
vocabulary so the head does not dominate), Mojo attention in both; `torch ops` runs the fused ops
as the torch reference, `Mojo ops` as the Mojo kernels. Context --context tokens per sequence.

On a GPU each timing is the mean of --inner back-to-back calls between two synchronisations
(single small kernels are launch-bound), and the step section also counts the CUDA kernels one
decode step launches (torch.profiler), per layer: (count at --layers) / layers, head included.

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/fused_ops.py --threads 2
    python3 benchmarks/fused_ops.py --device cuda --compile       # GPU host, PTX carried over
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.backend import select_attention, select_fused_ops
from mili.engine.model.attention import AttentionBackend
from mili.engine.model.checkpoint import write_random_checkpoint
from mili.engine.model.config import PRESETS
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps
from mili.engine.model.kv_cache import KVCache
from mili.engine.model.loader import load_model
from mili.engine.model.qwen3 import DecodeBatch, PrefillBatch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
BLOCK = 16
EPS = 1e-6


def best_of(fns: list[Callable[[], object]], repeats: int, device: str, inner: int) -> list[float]:
    """Best time of one call of each fn over `repeats` alternating rounds (seconds)."""
    inner = inner if device == "cuda" else 1
    for fn in fns:
        fn()  # warm-up: first touch, thread pools, compilation, module loading
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            _sync(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            best[i] = min(best[i], (time.perf_counter() - start) / inner)
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def op_cases(
    ops: FusedOps, dtype: torch.dtype, tokens: int, device: str
) -> dict[str, Callable[[], object]]:
    """name -> a call of `ops` on fresh-enough inputs (in-place ops rewrite their own buffers)."""
    g = torch.Generator().manual_seed(tokens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x = randn(tokens, HIDDEN)
    residual = randn(tokens, HIDDEN)
    weight = randn(HIDDEN)
    qkv = randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    head_weight = randn(HEAD_DIM)
    cos_sin = torch.rand(4096, HEAD_DIM, generator=g).to(device)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    num_blocks = tokens // BLOCK + 2
    slots = torch.randperm(num_blocks * BLOCK, generator=g)[:tokens].to(device)
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    gate_up = randn(tokens, 2 * INTER)
    return {
        "add_rms_norm": lambda: ops.add_rms_norm(x, residual, weight, EPS),
        "qk_norm_rope_kv": lambda: ops.qk_norm_rope_kv(
            qkv, head_weight, head_weight, EPS, cos_sin, positions, slots, k_cache, v_cache
        ),
        "silu_mul": lambda: ops.silu_mul(gate_up),
    }


class CompiledOps(TorchFusedOps):
    """torch.compile of the reference ops (inductor's fused C++ loops on CPU)."""

    name = "compiled"

    def __init__(self) -> None:
        reference = TorchFusedOps()
        self.add_rms_norm = torch.compile(reference.add_rms_norm, dynamic=False)  # type: ignore[method-assign]
        self.qk_norm_rope_kv = torch.compile(reference.qk_norm_rope_kv, dynamic=False)  # type: ignore[method-assign]
        self.silu_mul = torch.compile(reference.silu_mul, dynamic=False)  # type: ignore[method-assign]


def bench_ops(args: argparse.Namespace, mojo: FusedOps) -> None:
    implementations: list[FusedOps] = [mojo, TorchFusedOps()]
    if args.compile:
        implementations.append(CompiledOps())
    names = [impl.name for impl in implementations]
    print(f"{'op':16} {'dtype':5} {'T':>4} " + " ".join(f"{n + ' us':>12}" for n in names), end="")
    print(f" {'torch/mojo':>10}")
    for dtype_name in args.dtypes:
        for tokens in args.tokens:
            cases = [
                op_cases(impl, DTYPES[dtype_name], tokens, args.device) for impl in implementations
            ]
            for op in cases[0]:
                fns = [case[op] for case in cases]
                times = best_of(fns, args.repeats, args.device, args.inner)
                print(f"{op:16} {dtype_name:5} {tokens:4d} ", end="")
                print(" ".join(f"{t * 1e6:12.1f}" for t in times), end="")
                print(f" {times[1] / times[0]:9.2f}x", flush=True)


def bench_step(args: argparse.Namespace, mojo: FusedOps, attention: AttentionBackend) -> None:
    config = dataclasses.replace(
        # a small vocabulary (the step, not the head, is measured), so an EOS id inside it
        PRESETS["qwen3-0.6b"],
        num_hidden_layers=args.layers,
        vocab_size=4096,
        eos_token_id=2,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for dtype_name in args.dtypes:
            dtype = DTYPES[dtype_name]
            path = write_random_checkpoint(Path(tmp) / dtype_name, config, dtype=dtype)
            models = {
                name: load_model(path, device=args.device, attention=attention, fused_ops=ops)
                for name, ops in (("torch ops", TorchFusedOps()), ("Mojo ops", mojo))
            }
            for batch in args.batch:
                steps: list[Callable[[], object]] = []
                for model in models.values():
                    blocks = -(-(args.context + 1) // BLOCK)
                    cache = KVCache(config, batch * blocks, BLOCK, dtype=dtype, device=args.device)
                    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
                    prompts = [[7] * args.context] * batch
                    prefill = PrefillBatch.build(prompts, tables, BLOCK, device=args.device)
                    model.prefill(prefill, cache)
                    step = DecodeBatch.build(
                        [5] * batch, [args.context] * batch, tables, BLOCK, device=args.device
                    )
                    steps.append(functools.partial(model.decode, step, cache))
                    if args.device == "cuda":
                        print(f"  {model.fused_ops.name}: {count_cuda_kernels(steps[-1])} kernels")
                before, after = best_of(steps, args.repeats, args.device, 1)
                print(
                    f"decode step {dtype_name} B={batch} ctx={args.context} "
                    f"{args.layers} layers: torch ops {before * 1e3:.2f} ms, "
                    f"Mojo ops {after * 1e3:.2f} ms, {before / after:.2f}x",
                    flush=True,
                )


def count_cuda_kernels(step: Callable[[], object]) -> str:
    """CUDA kernels one call launches, as torch.profiler sees them (Mojo's PTX launches too)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return f"{len(kernels)} per step"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch and Mojo worker threads")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 512])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="add torch.compile'd reference")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--no-step", action="store_true", help="only the ops")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--inner", type=int, default=100, help="calls per timing on a GPU")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    mojo = select_fused_ops("mojo", args.device, head_dim=HEAD_DIM)
    attention = select_attention("mojo", args.device, head_dim=HEAD_DIM)
    print(
        f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}"
    )
    with torch.inference_mode():
        bench_ops(args, mojo)
    if not args.no_step:
        args.repeats = max(3, args.repeats // 10)
        bench_step(args, mojo, attention)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
