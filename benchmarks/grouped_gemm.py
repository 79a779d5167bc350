"""One grouped GEMM of a MoE layer on the CPU: the Mojo kernel against torch's grouped_mm.

The crossovers behind kernels/fused/cpu.py's rule (`GROUPED_GEMM_ROWS`,
`GROUPED_GEMM_MIN_BYTES`): for m rows on each of A active experts of Qwen3-30B-A3B's shapes
(gate_up [1536, 2048] and down [2048, 768] per expert), the median of --repeats calls of
`grouped_gemm_kernel` (the kernel whatever the size) and of `torch._grouped_mm` on the same
arguments, each after a read of --evict-mb MB with torch (the weights back in DRAM, and torch's
OpenMP threads busy just before, as the router's GEMM leaves them in the model).

    .venv/bin/python benchmarks/grouped_gemm.py --dtype fp32 --rows 1 2 3 4 8 16 32 64
    .venv/bin/python benchmarks/grouped_gemm.py --dtype bf16 --rows 1 4 --active 8 16 32 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.backend import select_fused_ops
from mili.engine.model.config import PRESETS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def median_ms(fn: Callable[[], object], repeats: int, evict: torch.Tensor | None) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.sum()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32, 64])
    parser.add_argument("--active", type=int, nargs="+", default=[128], help="experts with rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--evict-mb", type=int, default=1024, help="0: no read between calls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    config = PRESETS["qwen3-30b-a3b"]
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    num_experts = config.num_experts
    ops = select_fused_ops("mojo", "cpu", head_dim=config.head_dim)
    evict = torch.ones(args.evict_mb * 2**18) if args.evict_mb else None  # fp32 words
    g = torch.Generator().manual_seed(0)
    print(f"{args.dtype}, {num_experts} experts, torch {torch.__version__}, {args.threads} threads")
    print(f"{'GEMM':>8} {'active':>6} {'m':>4} {'weights MB':>10} {'mojo ms':>8} {'torch ms':>8} "
          f"{'torch/mojo':>10}")  # fmt: skip
    for name, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
        weight = torch.randn(num_experts, n, k, generator=g).to(dtype)
        for active in args.active:
            chosen = torch.randperm(num_experts, generator=g)[:active]
            for m in args.rows:
                counts = torch.zeros(num_experts, dtype=torch.int32)
                counts[chosen] = m
                offsets = counts.cumsum(0).to(torch.int32)
                rows = torch.randn(active * m, k, generator=g).to(dtype)
                # the Mojo CPU ops' own kernel, past their size checks (kernels/fused/cpu.py)
                kernel = partial(ops.grouped_gemm_kernel, rows, weight, offsets)  # type: ignore[attr-defined]
                mojo = median_ms(kernel, args.repeats, evict)
                grouped_mm = partial(torch._grouped_mm, rows, weight.mT, offs=offsets)
                torch_ms = median_ms(grouped_mm, args.repeats, evict)
                mb = active * weight[0].numel() * weight.element_size() / 2**20
                print(f"{name:>8} {active:>6} {m:>4} {mb:>10.0f} {mojo:>8.2f} {torch_ms:>8.2f} "
                      f"{torch_ms / mojo:>9.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
