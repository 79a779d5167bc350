"""The decode step's matrix-vector products at small batches: which torch call reads the weights
fastest (issue 33's batch-1 step: run 6 on an H200 spent 0.90 ms of its 1.64 ms of kernels in
cuBLAS's GEMVs, ~1.3 TB/s over the 1.19 GB of weights, where a copy runs at 4.26 TB/s).

For each projection of a preset's decoder layer (qkv, o, gate_up, down) and its head, in bf16,
at batches 1, 4 and 8, each variant of y = x @ W.T:

    linear      F.linear(x, W), what the model calls (cuBLAS's default backend)
    lt          the same under torch.backends.cuda.preferred_blas_library("cublaslt")
    cublas      the same under preferred_blas_library("cublas")
    w_x         (W @ x.T).T: the weight as the left operand (torch.mv at batch 1)
    mojo        the model's `linear` on the Mojo fused ops (--device cuda): fused_gpu.mojo's gemv
                kernel at batches up to 4, torch's F.linear above (where the column says linear)

On CUDA each call is timed inside a captured graph of 50 back-to-back calls (so launch gaps do
not count, as under decode's graphs), the graph replayed a few times between CUDA events. GB/s
counts the weight's bytes (x and y are noise beside them), beside a device-to-device copy
measured in the same run. The last lines sum the projections over the preset's layers plus the
head for `linear`, for `mojo` (the layers' projections: the head stays on F.linear in the
model) and for each shape's fastest variant: the batch-1 step's GEMV time each way.

    python3 benchmarks/gemv_gpu.py --device cuda                      # GPU host, ~20 s
    .venv/bin/python benchmarks/gemv_gpu.py --device cpu --preset tiny --repeats 2   # a check
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_gpu import copy_bandwidth
from benchmarks.presets import CHOICES, preset_config
from kernels.backend import select_fused_ops
from kernels.build import KernelBuildError

CALLS = 50  # calls per captured graph


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """Projection name -> (out_features, in_features) of one decoder layer, and the head."""
    c = preset_config(preset)
    head_dim = c.head_dim
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    return {
        "qkv": (q + 2 * kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "head": (c.vocab_size, c.hidden_size),
    }


@contextlib.contextmanager
def blas(backend: str | None) -> Iterator[None]:
    """cuBLAS's backend for the calls inside (None: leave it)."""
    if backend is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(backend)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def variants(device: torch.device) -> dict[str, tuple[str | None, Callable[..., torch.Tensor]]]:
    linear: Callable[..., torch.Tensor] = F.linear

    def w_x(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mv(w, x[0]).unsqueeze(0) if x.shape[0] == 1 else (w @ x.T).T

    found: dict[str, tuple[str | None, Callable[..., torch.Tensor]]] = {
        "linear": (None, linear),
        "w_x": (None, w_x),
    }
    if device.type == "cuda":
        found["lt"] = ("cublaslt", linear)
        found["cublas"] = ("cublas", linear)
        try:
            ops = select_fused_ops("mojo", device, head_dim=128)
        except KernelBuildError as e:
            print(f"no mojo variant: {e}", flush=True)
        else:
            found["mojo"] = (None, lambda x, w: ops.linear(x, w, None))
    return found


def time_us(
    fn: Callable[[], object], device: torch.device, repeats: int, backend: str | None
) -> float:
    """Median microseconds per call: on CUDA from graphs of CALLS calls, else the host clock."""
    with blas(backend):
        for _ in range(3):
            fn()
        if device.type != "cuda":
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e6)
            return statistics.median(samples)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
    graph.replay()  # the backend was chosen at capture: the graph holds its kernels
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(begin.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3-0.6b", choices=CHOICES)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator(device=device).manual_seed(0)
    copy = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {dtype}; copy {copy / 1e12:.2f} TB/s", flush=True)
    config = preset_config(args.preset)
    found = variants(device)
    print(f"{'shape':>8} {'N x K':>13} {'batch':>5}  " + "  ".join(f"{v:>19}" for v in found))
    best: dict[int, float] = dict.fromkeys(batches, 0.0)
    base: dict[int, float] = dict.fromkeys(batches, 0.0)
    model: dict[int, float] = dict.fromkeys(batches, 0.0)  # what the model calls, mojo ops
    with torch.inference_mode():
        for shape, (n, k) in shapes(args.preset).items():
            w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k**0.5
            weight_bytes = w.numel() * w.element_size()
            times = 1 if shape == "head" else config.num_hidden_layers
            for b in batches:
                x = torch.randn(b, k, device=device, dtype=dtype, generator=gen)
                reference = F.linear(x, w).float()
                cells, timed = [], {}
                for variant, (backend, fn) in found.items():
                    with blas(backend):
                        error = (fn(x, w).float() - reference).abs().max().item()
                    if error > 0.05 * reference.abs().max().item():
                        cells.append(f"{'WRONG':>19}")
                        continue
                    us = time_us(functools.partial(fn, x, w), device, args.repeats, backend)
                    timed[variant] = us
                    cells.append(f"{us:8.1f}us {weight_bytes / (us * 1e-6) / 1e9:5.0f}GB/s")
                print(f"{shape:>8} {f'{n}x{k}':>13} {b:>5}  " + "  ".join(cells), flush=True)
                base[b] += times * timed["linear"]
                best[b] += times * min(timed.values())
                on_mojo = "mojo" in timed and shape != "head"
                model[b] += times * timed["mojo" if on_mojo else "linear"]
    for b in batches:
        print(
            f"step's GEMVs at batch {b} ({config.num_hidden_layers} layers + head): linear "
            f"{base[b] / 1e3:.3f} ms, the model on mojo ops {model[b] / 1e3:.3f} ms, "
            f"each shape's fastest {best[b] / 1e3:.3f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
