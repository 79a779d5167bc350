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

The grouped GEMMs are the ops' (`FusedOps.grouped_gemm`): torch's grouped_mm, or a per-expert
loop where that has no graph-safe kernel (mili/engine/model/grouped_gemm.py), or on the CPU the
Mojo kernel where it is faster (kernels/fused/cpu.py). Tests and benchmarks may pin one of the
torch ways (`GroupedGemm`).

The gather back is a weighted sum over each token's own k results in its top-k order, so a
token's output never depends on which other tokens share its batch (or on atomics):
prefill batched one way and decode another give the same sums, as disaggregated = colocated
requires.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mili.engine.model.fused_ops import FusedOps
from mili.engine.model.grouped_gemm import GroupedGemm, grouped_gemm


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


def grouped_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    routing: Routing,
    ops: FusedOps,
    how: GroupedGemm | None = None,
) -> torch.Tensor:
    """x [T, H], gate_up_proj [E, 2 I, H], down_proj [E, H, I] -> [T, H] (module docstring);
    `how` pins a torch grouped GEMM, None runs the ops'."""
    num_tokens, top_k = routing.expert_ids.shape
    num_experts = gate_up_proj.shape[0]
    flat_ids = routing.expert_ids.reshape(-1)  # [T*k], token-major
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # [T*k] each
    xs = x[order // top_k]  # [T*k, H]: expert 0's rows, then expert 1's, ...
    # offsets[e]: where expert e's rows end (== start of e + 1's); an expert with no rows has
    # an empty slice. int32: what torch._grouped_mm takes.
    experts = torch.arange(num_experts, device=x.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # [E]

    def gemm(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if how is None:
            return ops.grouped_gemm(rows, weight, offsets)
        return grouped_gemm(rows, weight, offsets, how)

    gate_up = gemm(xs, gate_up_proj)  # [T*k, 2 I]
    ys = gemm(ops.silu_mul(gate_up), down_proj)  # [T*k, H]
    # slot_of[t*k + j]: the row of ys holding (token t, its j-th expert).
    slot_of = torch.empty_like(order)
    slot_of[order] = torch.arange(order.numel(), device=x.device)
    per_token = ys[slot_of].view(num_tokens, top_k, -1)  # [T, k, H]
    # The k results weighted in the activations' dtype, then summed in one reduction (as HF's
    # grouped experts do; its eager loop adds them one expert at a time, in expert-id order,
    # rounding each add: 1 bf16 step apart on some elements).
    return (per_token * routing.weights.unsqueeze(-1)).sum(dim=1)  # [T, H]


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
    """Router (`gate`, HF's name) + experts; `grouped_gemm` None runs the ops' grouped GEMM;
    tests and benchmarks may pin one of torch's."""

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
        self.grouped_gemm: GroupedGemm | None = None  # None: the ops'

    def route(self, x: torch.Tensor) -> Routing:
        return route(self.gate(x), self.top_k, norm_topk_prob=self.norm_topk_prob)

    def forward(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        weights = self.experts
        return grouped_experts(
            x, weights.gate_up_proj, weights.down_proj, self.route(x), ops, self.grouped_gemm
        )
