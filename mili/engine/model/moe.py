"""Qwen3-MoE's sparse MLP block: a top-k router and experts run as grouped GEMMs.

HF's `Qwen3MoeSparseMoeBlock`, token for token:

    logits  = h @ W_gate.T                        [T, E]      in the model's dtype
    probs   = softmax(logits, float32)            [T, E]
    w, ids  = topk(probs, k)                      [T, k]      renormalised (sum 1) when
                                                              norm_topk_prob; w cast back
    y[t]    = sum_j w[t, j] * expert_{ids[t, j]}(h[t])        expert = SwiGLU of width I

Experts live as two stacked tensors per layer, `gate_up_proj` [E, 2 I, H] (gate rows first, as
the dense MLP's merged gate/up) and `down_proj` [E, H, I]: the names and shapes transformers 5
gives them, filled at load from the published per-expert tensors (weight_map.py).

Grouped compute (never a loop over every expert per token): the T*k (token, expert) pairs are
sorted by expert, so each expert's rows are one contiguous slice of `xs`:

    flat ids  [T*k]  --stable sort-->  order [T*k]      xs = h[order // k]       [T*k, H]
    offsets   [E]    end of each expert's slice (searchsorted of the sorted ids)
    gate_up   = grouped GEMM(xs, gate_up_proj)          [T*k, 2 I]
    act       = silu(gate) * up                         [T*k, I]     one op over all rows
    ys        = grouped GEMM(act, down_proj)            [T*k, H]
    y         = sum_j w[t, j] * ys[slot of (t, j)]      [T, H]       gather back, weighted sum

Two ways to run the grouped GEMMs, the same arithmetic (`GroupedGemm`):

- "grouped_mm": `torch._grouped_mm(xs, W.mT, offs=offsets)`, one call per GEMM with the
  offsets left on the device. Every shape is static (T*k rows whatever the routing) and nothing
  reads a device value on the host, so a decode step with it is graph-capturable and
  `torch.compile`-safe. On CUDA torch runs it as one CUTLASS grouped GEMM for bf16 on sm_90 and
  sm_100 (dimensions multiples of 8); elsewhere on CUDA its fallback copies the offsets to the
  host, so there we take "loop" and decode runs eagerly (`is_graph_safe`). On CPU torch's
  implementation loops over the groups in C++; it measured as fast as or faster than "loop"
  (benchmarks/moe.py, docs/benchmarks.md), so the CPU runs it too: one formulation, and the
  CPU tests check the CUDA one.
- "loop": one GEMM per expert that got rows, over its contiguous slice; the slice bounds come to
  the host (one sync per layer). The fallback where grouped_mm has no graph-safe kernel.

The gather back is a weighted sum over each token's own k results in its top-k order, so a
token's output never depends on which other tokens share its batch (or on atomics):
prefill batched one way and decode another give the same sums, as disaggregated = colocated
requires.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mili.engine.model.fused_ops import FusedOps

GroupedGemm = Literal["loop", "grouped_mm"]


class Routing(NamedTuple):
    """Each token's experts and their weights."""

    weights: torch.Tensor  # [T, k] in the activations' dtype
    expert_ids: torch.Tensor  # [T, k] int64


def route(logits: torch.Tensor, top_k: int, *, norm_topk_prob: bool) -> Routing:
    """Router logits [T, E] -> top-k experts per token, HF's arithmetic (softmax in float32;
    `torch.topk`'s order: descending weight, deterministic for equal inputs)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(logits.dtype), expert_ids)


def default_grouped_gemm(device: torch.device, dtype: torch.dtype) -> GroupedGemm:
    """What runs on `device` in `dtype` (module docstring): grouped_mm where torch has it
    without a host sync (CPU; CUDA bf16 on sm_90/sm_100), else the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        return "loop"
    if device.type != "cuda":
        return "grouped_mm"
    major, _ = torch.cuda.get_device_capability(device)
    return "grouped_mm" if dtype == torch.bfloat16 and major in (9, 10) else "loop"


def is_graph_safe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether MoE layers on `device` in `dtype` may be captured in a CUDA graph."""
    return default_grouped_gemm(device, dtype) == "grouped_mm"


def grouped_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    routing: Routing,
    ops: FusedOps,
    grouped_gemm: GroupedGemm,
) -> torch.Tensor:
    """x [T, H], gate_up_proj [E, 2 I, H], down_proj [E, H, I] -> [T, H] (module docstring)."""
    num_tokens, top_k = routing.expert_ids.shape
    num_experts = gate_up_proj.shape[0]
    flat_ids = routing.expert_ids.reshape(-1)  # [T*k], token-major
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # [T*k] each
    xs = x[order // top_k]  # [T*k, H]: expert 0's rows, then expert 1's, ...
    # offsets[e]: where expert e's rows end (== start of e + 1's); an expert with no rows has
    # an empty slice. int32: what torch._grouped_mm takes.
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # [E]
    if grouped_gemm == "grouped_mm":
        gate_up = torch._grouped_mm(xs, gate_up_proj.mT, offs=offsets)  # [T*k, 2 I]
        ys = torch._grouped_mm(ops.silu_mul(gate_up), down_proj.mT, offs=offsets)  # [T*k, H]
    else:
        ys = _loop(xs, gate_up_proj, down_proj, offsets, ops)
    # slot_of[t*k + j]: the row of ys holding (token t, its j-th expert).
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(order.numel(), device=x.device)
    per_token = ys[slot_of].view(num_tokens, top_k, -1)  # [T, k, H]
    # HF multiplies in the activations' dtype, then adds the k results: so do we, in top-k order.
    return (per_token * routing.weights.unsqueeze(-1)).sum(dim=1)  # [T, H]


def _loop(
    xs: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    offsets: torch.Tensor,
    ops: FusedOps,
) -> torch.Tensor:
    """One GEMM pair per expert with rows, over its contiguous slice of xs [T*k, H]."""
    bounds = [0, *offsets.tolist()]  # the host sync that keeps this path off CUDA graphs
    intermediate = down_proj.shape[2]
    active = [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)]
    active = [(e, s, t) for e, s, t in active if t > s]
    gate_up = xs.new_empty(xs.shape[0], 2 * intermediate)  # [T*k, 2 I]
    for e, start, end in active:
        torch.mm(xs[start:end], gate_up_proj[e].t(), out=gate_up[start:end])
    act = ops.silu_mul(gate_up)
    ys = xs.new_empty(xs.shape)  # [T*k, H]
    for e, start, end in active:
        torch.mm(act[start:end], down_proj[e].t(), out=ys[start:end])
    return ys


def reference_experts(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """The naive loop the grouped path is checked (and benchmarked) against: every expert over
    every token, masked by the routing weight (0 where the token did not pick it)."""
    num_experts, intermediate = gate_up_proj.shape[0], down_proj.shape[2]
    out = torch.zeros_like(x)
    for e in range(num_experts):
        # [T]: token t's weight for expert e, 0 if e is not among its top k
        weight = (routing.weights * (routing.expert_ids == e)).sum(dim=-1)
        gate, up = F.linear(x, gate_up_proj[e]).split(intermediate, dim=-1)
        out += F.linear(F.silu(gate) * up, down_proj[e]) * weight.unsqueeze(-1)
    return out


class Experts(nn.Module):
    """The stacked expert weights of one layer (transformers 5's `Qwen3MoeExperts` names)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        # Expert e's gate_proj in rows [0, I) of gate_up_proj[e], its up_proj in [I, 2 I).
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )


class SparseMoeBlock(nn.Module):
    """Router (`gate`, HF's name) + experts; `grouped_gemm` None runs what the activations'
    device and dtype allow (`default_grouped_gemm`); tests and benchmarks may pin one."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        *,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.grouped_gemm: GroupedGemm | None = None  # None: by the weights' device

    def route(self, x: torch.Tensor) -> Routing:
        return route(self.gate(x), self.top_k, norm_topk_prob=self.norm_topk_prob)

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights = self.experts
        grouped_gemm = self.grouped_gemm or default_grouped_gemm(x.device, x.dtype)
        return grouped_experts(
            x, weights.gate_up_proj, weights.down_proj, self.route(x), ops, grouped_gemm
        )
