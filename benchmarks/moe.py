"""One Qwen3-MoE layer's experts: grouped compute against the naive loop, side by side.

Shapes of Qwen3-30B-A3B (mili.engine.model.config.PRESETS["qwen3-30b-a3b"]): hidden 2048, 128
experts of moe_intermediate 768, 8 active per token; one layer, random weights (N(0, 0.02)),
tokens routed by a random router as the model routes them (softmax, top-8, renormalised). For T
tokens (1: a decode step at batch 1; 64: a batch of 64 or a prompt chunk), each column is the
best of --repeats alternating rounds, seconds per call of the experts (routing excluded, the
same routing for all), each call with the weights out of the caches (--evict-mb):

    naive        every expert over every token, masked by its routing weight (the reference
                 the tests check against: mili.engine.model.moe.reference_experts)
    per token    a loop over tokens, each running its k experts as GEMVs (what "never a Python
                 loop over every expert per token" rules out): an expert's weights are read
                 once per token that picked it
    hf loop      transformers' eager Qwen3MoeExperts: a loop over the experts that got a
                 token, each gathering its tokens (where) and adding back (index_add_)
    grouped loop ours, pairs sorted by expert, one GEMM per active expert over its contiguous
                 slice, one SiLU*mul for all rows (grouped_experts, "loop")
    grouped_mm   the same sorted rows through torch._grouped_mm with the offsets on the
                 device (on CPU torch loops over the groups in C++) (grouped_experts,
                 "grouped_mm"): the torch ops' path, and CUDA's
    mojo         ours as the engine runs it on CPU (the Mojo ops, `--attention auto`/`mojo`):
                 the sorted rows through the Mojo grouped GEMM (kernels/mojo/experts_cpu.mojo)
                 where an expert has few rows, else torch._grouped_mm (kernels/fused/cpu.py)

The ratios are of mojo, the engine's CPU path. Target (issue 32): >= 3x the naive loop at 64
tokens. The script prints the ratios and whether the target is met, and `weights ms`: the time
to read the active experts' weights once (a sum over them), a rough floor of any exact method:
at 64 tokens nearly every expert is active, so grouped and naive both read all the weights and
differ only in naive's T x E GEMM rows and in how close each gets to the read bandwidth (a
streaming GEMV reads faster than this sum; docs/benchmarks.md).

    flock /tmp/mili-bench.lock .venv/bin/python benchmarks/moe.py --threads 2 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.backend import select_fused_ops
from mili.engine.model.config import PRESETS
from mili.engine.model.fused_ops import TorchFusedOps
from mili.engine.model.moe import Routing, grouped_experts, reference_experts, route

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET = 3.0


def hf_loop(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """transformers 5.23's Qwen3MoeExperts.forward (eager), for the same tensors."""
    out = torch.zeros_like(x)
    num_experts = gate_up.shape[0]
    mask = torch.nn.functional.one_hot(routing.expert_ids, num_classes=num_experts)
    mask = mask.permute(2, 1, 0)  # [E, k, T]
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, token = torch.where(mask[e[0]])
        gate, up = torch.nn.functional.linear(x[token], gate_up[e[0]]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e[0]])
        out.index_add_(0, token, y * routing.weights[token, slot, None])
    return out


def per_token(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, routing: Routing
) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = down.shape[2]
    ids = routing.expert_ids.tolist()
    for t, (weights, experts) in enumerate(zip(routing.weights, ids, strict=True)):
        for w, e in zip(weights, experts, strict=True):
            gate, up = (gate_up[e] @ x[t]).split(inter)
            out[t] += (down[e] @ (torch.nn.functional.silu(gate) * up)) * w
    return out


def read_weights(
    gate_up: torch.Tensor, down: torch.Tensor, active: list[int]
) -> Callable[[], object]:
    """Reads every byte of the active experts once (as float32 words: a cheap vector sum)."""

    def read() -> object:
        return [(gate_up[e].view(torch.float32).sum(), down[e].view(torch.float32).sum())
                for e in active]  # fmt: skip

    return read


def best_of(
    fns: list[Callable[[], object]], repeats: int, evict: torch.Tensor | None
) -> list[float]:
    """Best of `repeats` alternating rounds; before each call a read of `evict` (bigger than
    the last-level cache) puts the weights back in DRAM, where a model of 48 layers has them."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if evict is not None:
                evict.sum()
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-naive-above", type=int, default=256, help="naive is T x E GEMMs")
    parser.add_argument(
        "--evict-mb",
        type=int,
        default=1024,
        help="MB read before each call to push the weights out of the caches (0: none; this "
        "VM's L3 holds 480 MB, the 8 experts of one token fit in it)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    config = PRESETS["qwen3-30b-a3b"]
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.02).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * 0.02).to(dtype)
    router = (torch.randn(num_experts, hidden, generator=g) * 0.02).to(dtype)
    ops = TorchFusedOps()
    evict = torch.ones(args.evict_mb * 2**18) if args.evict_mb else None  # fp32 words
    mojo_ops = select_fused_ops("mojo", "cpu", head_dim=config.head_dim)
    weight_gb = (gate_up.numel() + down.numel()) * gate_up.element_size() / 1e9
    print(
        f"Qwen3-30B-A3B MoE layer: hidden {hidden}, {num_experts} experts x {inter}, top-{top_k}, "
        f"{args.dtype} ({weight_gb:.2f} GB of experts), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}"
    )
    header = f"{'tokens':>6} {'active':>6} {'weights ms':>10} {'naive ms':>9} {'per token ms':>12} "
    header += f"{'hf loop ms':>10} {'grouped loop ms':>15} {'grouped_mm ms':>13} {'mojo ms':>8} "
    header += f"{'naive/ours':>10} {'per token/ours':>14} {'hf/ours':>7} {'grouped_mm/ours':>15}"
    print(header)
    met = True
    with torch.inference_mode():
        for num_tokens in args.tokens:
            x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
            routing = route(x @ router.T, top_k, norm_topk_prob=True)
            active = routing.expert_ids.unique().tolist()
            inputs = (x, gate_up, down, routing)
            fns: list[Callable[[], object]] = [
                read_weights(gate_up, down, active),
                partial(per_token, *inputs),
                partial(hf_loop, *inputs),
                partial(grouped_experts, *inputs, ops, "loop"),
                partial(grouped_experts, *inputs, ops, "grouped_mm"),
                partial(grouped_experts, *inputs, mojo_ops),
            ]
            if num_tokens <= args.skip_naive_above:
                fns.insert(0, partial(reference_experts, *inputs))
            times = best_of(fns, args.repeats, evict)
            naive = times.pop(0) if num_tokens <= args.skip_naive_above else float("nan")
            floor, token_loop, hf, grouped, grouped_mm, ours = times
            ratio = naive / ours
            if num_tokens == 64:
                met = ratio >= TARGET
            print(
                f"{num_tokens:>6} {len(active):>6} {floor * 1e3:>10.2f} {naive * 1e3:>9.2f} "
                f"{token_loop * 1e3:>12.2f} {hf * 1e3:>10.2f} {grouped * 1e3:>15.2f} "
                f"{grouped_mm * 1e3:>13.2f} {ours * 1e3:>8.2f} {ratio:>9.1f}x "
                f"{token_loop / ours:>13.1f}x {hf / ours:>6.2f}x {grouped_mm / ours:>14.2f}x"
            )
    if 64 in args.tokens:
        print(f"target mojo >= {TARGET:g}x naive at 64 tokens: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
