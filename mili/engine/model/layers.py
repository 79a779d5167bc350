"""Qwen3's position-independent building blocks: RMSNorm, merged projections, the SwiGLU MLP.

Projections that read the same input run as one GEMM over weights stacked along the output
dimension (`MergedLinear`: q/k/v, gate/up), one launch instead of two or three. Their
checkpoints keep HF's separate tensors; `MergedLinear.parts` says which rows each one fills, and
mili/engine/model/weight_map.py turns that into the loader's HF name -> (parameter, rows) table.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Holds an RMSNorm's weight and eps; the model applies it through its FusedOps."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps


class MergedLinear(nn.Module):
    """Several HF projections of one input as one GEMM: y = x @ W.T (+ b), W = [W_a; W_b; ...].

    `parts` maps each HF module name (relative to this module's parent: "q_proj", ...) to its
    output rows, in stacking order; y's columns come out in that order.
    """

    def __init__(self, in_features: int, parts: dict[str, int], *, bias: bool) -> None:
        super().__init__()
        self.parts = dict(parts)
        out_features = sum(self.parts.values())
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def row_slices(self) -> dict[str, slice]:
        """HF module name -> its rows of `weight` (and entries of `bias`)."""
        slices, start = {}, 0
        for name, rows in self.parts.items():
            slices[name] = slice(start, start + rows)
            start += rows
        return slices


class MLP(nn.Module):
    """SwiGLU's weights: down(silu(gate(x)) * up(x)), gate and up as one GEMM; the decoder layer
    runs it through its FusedOps (add_rms_norm_linear, silu_mul_linear), the norm fused in."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=False
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
