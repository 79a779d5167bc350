"""GPU attention benchmark: MILI's PTX kernels (kernels/gpu.py) against torch SDPA on one GPU.

    MILI_CACHE_DIR=<dir> python benchmarks/attention_gpu.py

where <dir> holds the PTX built on a machine with the Mojo toolchain by
`MILI_CACHE_DIR=<dir> mili kernels build --gpu --no-cpu` (or pass --kernel-dir).

Prefill: bf16, causal, D=128, 32 q / 8 kv heads, one sequence of T new tokens (start 0) read from a
paged cache (block 16, random block table), T in 1024 / 4096 / 16384. TFLOP/s counts the causal
half: 4 * T * T * D * H / 2. The same q/k/v go to torch SDPA restricted to the flash backend
(contiguous [1, H, T, D], k/v heads repeated to H) in the same run. On CUDA each T has a second
row, `3cta`: flash_prefill's narrow variant (32-key tiles, Q re-read from shared memory, 3 CTAs
an SM: kernels/mojo/flash_prefill_gpu.mojo's header) on the same inputs, against the same SDPA.

Decode: bf16, 32 q / 8 kv heads, D=128, block 16, random block tables; (batch, context) in
(64, 4096) and (1, 256) by default. GB/s counts the K and V bytes read: B * context * KVH * D * 2
(K and V) * 2 bytes, as a share of this device's peak: the datasheet figure for the device's name
(H100 SXM 3.35 TB/s, H200 4.8 TB/s) and, side by side, a device-to-device copy measured in the
same run. Ours is timed as called (eager: the Python launch path included) and replayed from a
CUDA graph (the GPU time a captured decode step pays), next to a gather + SDPA decode (the block
table gathered into contiguous K/V, then SDPA) in the same process.

Each measurement: a parity spot check first, warm-up, then CUDA events around repeated launches.
Rows print as they finish.

    python benchmarks/attention_gpu.py --device cpu --lengths 128 --decode 4x256 --iters 2

runs the same measurements through the Mojo CPU kernels (host clock, no CUDA graph, a 64 MiB
copy for the bandwidth): a check of this script on any machine, not a CPU benchmark
(attention_cpu.py is that).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.build import build_cpu, gpu_kernel_dir
from kernels.cpu import CpuKernels
from kernels.gpu import GpuKernels

# Datasheet HBM bandwidth by device name (bytes/s); other devices use the measured copy.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def datasheet_bandwidth(name: str) -> float | None:
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return None


def copy_bandwidth(dev: torch.device) -> float:
    """A copy within `dev`'s memory (1 GiB on a GPU, 64 MiB on the CPU): bytes read + written
    per second."""
    src = torch.empty(1 << (30 if dev.type == "cuda" else 26), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), dev, warmup=2, iters=10)
    return 2 * src.numel() / (ms * 1e-3)


def time_ms(
    fn: Callable[[], object], dev: torch.device, *, warmup: int = 3, iters: int = 10
) -> float:
    """Mean ms per call over `iters` back-to-back calls: CUDA events on a GPU; on the CPU the
    host clock (a CPU kernel has finished when it returns)."""
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        start_s = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start_s) * 1e3 / iters
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def paged(
    k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter [B, L, KVH, D] keys/values into a cache of randomly permuted blocks."""
    batch, length, kv_heads, head_dim = k.shape
    per_seq = -(-length // block_size)
    num_blocks = batch * per_seq
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = perm.view(batch, per_seq).to(k.device)
    pad = per_seq * block_size - length
    shape = (batch, per_seq, block_size, kv_heads, head_dim)
    k_blocks = F.pad(k, (0, 0, 0, 0, 0, pad)).reshape(shape)
    v_blocks = F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(shape)
    k_cache = torch.empty(
        (num_blocks, block_size, kv_heads, head_dim), dtype=k.dtype, device=k.device
    )
    v_cache = torch.empty_like(k_cache)
    k_cache[table.long().flatten()] = k_blocks.flatten(0, 1)
    v_cache[table.long().flatten()] = v_blocks.flatten(0, 1)
    return k_cache, v_cache, table


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def bench_prefill(
    kernels: CpuKernels | GpuKernels,
    dev: torch.device,
    length: int,
    args: argparse.Namespace,
    variant: GpuKernels | None = None,
) -> list[dict]:
    """One row for `kernels`' prefill, then one for `variant`'s (its other flash_prefill) if
    given, each against the same SDPA timing."""
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(length, heads, head_dim, generator=gen).to(dev, dtype)
    k = torch.randn(1, length, kv_heads, head_dim, generator=gen).to(dev, dtype)
    v = torch.randn(1, length, kv_heads, head_dim, generator=gen).to(dev, dtype)
    k_cache, v_cache, table = paged(k, v, block, gen)
    cu = torch.tensor([0, length], dtype=torch.int32, device=dev)
    starts = torch.zeros(1, dtype=torch.int32, device=dev)
    scale = head_dim**-0.5

    def run(on: CpuKernels | GpuKernels) -> Callable[[], torch.Tensor]:
        return lambda: on.prefill(q, k[0], v[0], cu, starts, k_cache, v_cache, table, scale=scale)

    group = heads // kv_heads
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, T, D]
    ks = k[0].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    vs = v[0].repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()

    def sdpa() -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    reference = sdpa()[0].transpose(0, 1)
    iters = args.iters if length <= 4096 else max(2, args.iters // 4)
    ms_sdpa = time_ms(sdpa, dev, iters=iters)
    flops = 4 * length * length * head_dim * heads / 2
    rows = []
    for name, on in (("ours", kernels), ("3cta", variant)):
        if on is None:
            continue
        ours = run(on)
        err = rel_err(ours(), reference)
        ms_ours = time_ms(ours, dev, iters=iters)
        rows.append(
            {
                "kernel": name,
                "T": length,
                "ours_ms": ms_ours,
                "sdpa_ms": ms_sdpa,
                "ours_tflops": flops / ms_ours / 1e9,
                "sdpa_tflops": flops / ms_sdpa / 1e9,
                "max_rel_err": err,
            }
        )
    return rows


SPLIT_SWEEP = (1, 2, 3, 4, 6, 8, 16, 32)


def bench_decode(
    kernels: CpuKernels | GpuKernels,
    dev: torch.device,
    batch: int,
    context: int,
    args: argparse.Namespace,
) -> dict:
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dev, dtype)
    k = torch.randn(batch, context, kv_heads, head_dim, generator=gen).to(dev, dtype)
    v = torch.randn(batch, context, kv_heads, head_dim, generator=gen).to(dev, dtype)
    k_cache, v_cache, table = paged(k, v, block, gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    scale = head_dim**-0.5

    def ours() -> torch.Tensor:
        return kernels.decode(q, k_cache, v_cache, table, seq_lens, scale=scale)

    # Reference on the unpaged k/v (SDPA, any backend), GQA by repeating kv heads.
    group = heads // kv_heads
    ks = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, L, D]
    vs = v.repeat_interleave(group, dim=2).transpose(1, 2)
    reference = F.scaled_dot_product_attention(q[:, :, None, :], ks, vs, scale=scale)[:, :, 0]
    err = rel_err(ours(), reference)
    del ks, vs
    iters = args.iters * 5
    ms = time_ms(ours, dev, warmup=5, iters=iters)

    ms_graph = None
    if dev.type == "cuda":
        graph = torch.cuda.CUDAGraph()  # warmed up above: functions loaded, scratch sized
        with torch.cuda.graph(graph):
            ours()
        ms_graph = time_ms(graph.replay, dev, warmup=5, iters=iters)

    def gather_sdpa() -> torch.Tensor:
        # [B, blocks, S, KVH, D] -> [B, KVH, L, D]; SDPA with GQA by repeating kv heads
        idx = table.long()
        kg = k_cache[idx].flatten(1, 2)[:, :context].transpose(1, 2)
        vg = v_cache[idx].flatten(1, 2)[:, :context].transpose(1, 2)
        kg = kg.repeat_interleave(group, dim=1)
        vg = vg.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q[:, :, None, :], kg, vg, scale=scale)[:, :, 0]

    err_gather = rel_err(gather_sdpa(), reference)
    ms_gather = time_ms(gather_sdpa, dev, warmup=3, iters=iters)

    # The same call at fixed split counts (the plan picks one from shapes alone: geometry.
    # decode_splits), each split at least 64 keys: which count the plan should have picked.
    sweep, err_sweep = {}, 0.0
    for n in SPLIT_SWEEP:
        if n > 1 and context // n < 64:
            break

        def split(n: int = n) -> torch.Tensor:
            return kernels.decode(q, k_cache, v_cache, table, seq_lens, scale=scale, num_splits=n)

        err_sweep = max(err_sweep, rel_err(split(), reference))
        sweep[n] = time_ms(split, dev, warmup=2, iters=iters)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * k.element_size()
    return {
        "B": batch,
        "context": context,
        "ms": ms,
        "ms_graph": ms_graph,
        "ms_gather": ms_gather,
        "gbs": kv_bytes / (ms * 1e-3) / 1e9,
        "gbs_graph": None if ms_graph is None else kv_bytes / (ms_graph * 1e-3) / 1e9,
        "gbs_gather": kv_bytes / (ms_gather * 1e-3) / 1e9,
        "max_rel_err": err,
        "max_rel_err_gather": err_gather,
        "split_ms": sweep,
        "max_rel_err_splits": err_sweep,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--kernel-dir",
        type=Path,
        default=None,
        help="PTX directory (default: this source's, in the kernel cache)",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument(
        "--decode",
        type=str,
        nargs="+",
        default=["64x4096", "1x256"],
        help="decode shapes as BATCHxCONTEXT",
    )
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    dev = torch.device(args.device)
    kernels: CpuKernels | GpuKernels
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA GPU", file=sys.stderr)
            return 1
        kernels = GpuKernels(args.kernel_dir or gpu_kernel_dir())
        variant = GpuKernels(kernels.kernel_dir, flash_prefill="flash_prefill_3cta")
        name = torch.cuda.get_device_name()
    else:
        kernels = CpuKernels.from_path(build_cpu())
        variant = None  # the CPU kernels have one prefill
        name = f"CPU, {torch.get_num_threads()} torch threads"
    measured = copy_bandwidth(dev)
    sheet = datasheet_bandwidth(name) if dev.type == "cuda" else None
    peak = sheet or measured
    print(f"device: {name}  torch {torch.__version__}")
    sheet_text = f"{sheet / 1e12:.2f} TB/s" if sheet else "unknown"
    print(
        f"peak bandwidth: datasheet {sheet_text}, measured copy {measured / 1e12:.2f} TB/s; "
        f"% of peak below uses {peak / 1e12:.2f} TB/s",
        flush=True,
    )
    print("\nprefill  bf16 causal D=128 H=32 KVH=8 B=1 (paged cache, block 16)")
    print(
        f"{'T':>6} {'ours ms':>9} {'ours TF/s':>10} {'sdpa ms':>9} {'sdpa TF/s':>10} "
        f"{'ours/sdpa':>9} {'max rel err':>12}",
        flush=True,
    )
    for length in args.lengths:
        for r in bench_prefill(kernels, dev, length, args, variant):
            print(
                f"{r['T']:>6} {r['ours_ms']:>9.3f} {r['ours_tflops']:>10.3g} {r['sdpa_ms']:>9.3f} "
                f"{r['sdpa_tflops']:>10.3g} {r['ours_tflops'] / r['sdpa_tflops']:>9.2f} "
                f"{r['max_rel_err']:>12.2e}" + ("" if r["kernel"] == "ours" else "  3cta"),
                flush=True,
            )
    # GB/s and % of peak: the graph replay where there is one (a captured step's cost), else
    # the eager call.
    print("\ndecode  bf16 H=32 KVH=8 D=128 block 16 (random block tables)")
    print(
        f"{'B':>3} {'ctx':>6} {'ours us':>9} {'graph us':>9} {'GB/s':>7} {'% peak':>7} "
        f"{'gather us':>10} {'GB/s':>7} {'% peak':>7} {'ours/gather':>11} {'max rel err':>12}",
        flush=True,
    )
    sweeps = []
    for shape in args.decode:
        batch, context = (int(x) for x in shape.split("x"))
        r = bench_decode(kernels, dev, batch, context, args)
        sweeps.append(r)
        ms_best = r["ms_graph"] or r["ms"]
        gbs_best = r["gbs_graph"] or r["gbs"]
        graph_us = "-" if r["ms_graph"] is None else f"{1e3 * r['ms_graph']:.1f}"
        print(
            f"{r['B']:>3} {r['context']:>6} {1e3 * r['ms']:>9.1f} {graph_us:>9} "
            f"{gbs_best:>7.0f} {100 * gbs_best * 1e9 / peak:>7.1f} "
            f"{1e3 * r['ms_gather']:>10.1f} {r['gbs_gather']:>7.0f} "
            f"{100 * r['gbs_gather'] * 1e9 / peak:>7.1f} {r['ms_gather'] / ms_best:>11.2f} "
            f"{max(r['max_rel_err'], r['max_rel_err_gather']):>12.2e}",
            flush=True,
        )
    print("\ndecode at fixed split counts (eager us; the table's row is the plan's choice)")
    for r in sweeps:
        cells = "  ".join(f"{n}:{1e3 * ms:.1f}" for n, ms in r["split_ms"].items())
        print(
            f"{r['B']:>3} {r['context']:>6}  {cells}  max rel err {r['max_rel_err_splits']:.2e}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
