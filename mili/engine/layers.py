"""Qwen3's position-independent building blocks: RMSNorm and the SwiGLU MLP.

Parameter names match HF transformers (`weight`, `gate_proj`, `up_proj`, `down_proj`) so a module
tree built from these classes has exactly the checkpoint's tensor names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension, computed in float32.

    The cast back to the input dtype happens *before* the weight multiply, as in HF's
    `Qwen3RMSNorm`; doing it after would change bf16 results in the last bit.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
