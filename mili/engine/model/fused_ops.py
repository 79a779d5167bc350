"""The fused elementwise ops of a decoder layer: their interface, and the torch reference.

Between its GEMMs a Qwen3 layer does elementwise work that torch runs as many small kernels
(an RMSNorm alone is 6-8: cast, pow, mean, add, rsqrt, mul, cast, mul). `FusedOps` names that
work as a few ops, each one kernel in a fused implementation (the Mojo kernels in
`kernels/fused/`), and the projections with it, which the GPU's gemv kernels fuse with the
elementwise work on either side at decode's batch sizes; `TorchFusedOps` below is the one torch
reference of each, the fallback on any device, and what the kernels are tested against. The
model calls them per layer:

    qkv, residual = add_rms_norm_linear(x, residual, W_qkv)
                                       residual += x (layer 0: residual = x, the embeddings);
                                       h = rms_norm(residual); qkv = linear(h, W_qkv)
    q, k, v = qk_norm_rope_kv(qkv)     per-head RMSNorm of q and k, RoPE, K/V into the cache
    ...attention, o = linear(attn, W_o)...
    gate_up, residual = add_rms_norm_linear(o, residual, W_gate_up)   post-attention norm
    x = silu_mul_linear(gate_up, W_down)  silu(gate) * up, then the down projection
    h = add_rms_norm(x, residual)      the final norm (and a MoE layer's post-attention one)

`linear` is F.linear, except that at decode's batch sizes a GPU implementation may read the
weights with a kernel of its own (cuBLAS's GEMM tiles are slow there: docs/benchmarks.md).

A MoE layer's experts (moe.py) run their two GEMMs as `grouped_gemm` over rows sorted by
expert: not elementwise, but like the ops above a kernel with one torch reference
(mili/engine/model/grouped_gemm.py) and, on the CPU, a Mojo implementation.

Numerics are HF transformers' `Qwen3RMSNorm`, `apply_rotary_pos_emb` and `Qwen3MLP` op for op,
including where they round to the activation dtype (bf16 results differ in the last bit
otherwise): RMSNorm normalises in float32, casts back, then multiplies by the weight in the
activation dtype; RoPE multiplies and adds in the activation dtype with cos/sin cast to it.

Shapes (T tokens, H q heads, KVH kv heads, D head_dim, N blocks of S slots, P positions):

    x, residual   [T, hidden]            activation dtype
    qkv           [T, (H + 2 KVH) * D]   q | k | v of each token (one GEMM's output rows)
    cos_sin       [P, D] float32         row p: cos(p * f) in [:D/2], sin(p * f) in [D/2:]
                                         (`RotaryEmbedding.cos_sin_table`, scaled by YaRN)
    positions     [T] int64, slot_mapping [T] int64 (kv_cache.py)
    k/v_cache     [N, S, KVH, D]         one layer of `KVCache`, the activation dtype
    gate_up       [T, 2 I]               gate | up of each token
    rows          [R, K]                 grouped_gemm: rows sorted by expert; weight [E, N, K],
                                         offsets [E] int32 (each expert's end row)
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from mili.engine.model.grouped_gemm import grouped_gemm
from mili.engine.model.rope import apply_rope


class FusedOps(Protocol):
    """The elementwise ops between a layer's GEMMs; one implementation per device family.

    The projections (`linear`, `silu_mul_linear`, `add_rms_norm_linear`) have their one
    composition here, F.linear and the family's own elementwise ops: implementations subclass
    FusedOps and inherit it, and the GPU's overrides it with its gemv kernels where they apply.
    """

    name: str
    # True where a call does no host sync and allocates only from torch's caching allocator on
    # the current stream, so a CUDA graph can capture it.
    is_graph_safe: bool

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, hidden] -> rms_norm(x) * weight, a new tensor."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place, rounded to its dtype), then rms_norm(residual) * weight.

        The result may be written over x's memory: x must not be read afterwards.
        """
        ...

    def qk_norm_rope_kv(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos_sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head RMSNorm of q and k (weights [D]), RoPE at `positions`, then k and v into
        the cache at `slot_mapping`. Returns q [T, H, D] contiguous and the cached k, v
        [T, KVH, D] (views; attention backends that read the new tokens from k/v use them).

        qkv may be modified in place.
        """
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2 I] -> silu(gate) * up, [T, I] (a new tensor)."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [T, K], weight [N, K], bias [N] or None -> x @ weight.T (+ bias), [T, N]."""
        return F.linear(x, weight, bias)

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 I], weight [N, I] -> linear(silu_mul(gate_up), weight), [T, N]: one
        kernel where the GPU's gemv makes the product as it reads it."""
        return self.linear(self.silu_mul(gate_up), weight, None)

    def add_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(h, weight, bias), r): r = x + residual (x where residual is None), rounded,
        h = rms_norm(r) * norm_weight; one kernel where the GPU's gemv norms its input itself.
        r may be residual itself, updated in place, or a new tensor: use the one returned. x
        must not be read afterwards."""
        if residual is None:
            h, residual = self.rms_norm(x, norm_weight, eps), x
        else:
            h = self.add_rms_norm(x, residual, norm_weight, eps)
        return self.linear(h, weight, bias), residual

    def grouped_gemm(
        self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """rows [R, K] sorted by expert, weight [E, N, K], offsets [E] -> [R, N], each row times
        its expert's weight transposed (mili/engine/model/grouped_gemm.py)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dimension, computed in float32.

    The cast back to x's dtype happens *before* the weight multiply, as in HF's `Qwen3RMSNorm`;
    doing it after would change bf16 results in the last bit.
    """
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class TorchFusedOps(FusedOps):
    """The reference: plain torch ops on any device and dtype (many kernels per op)."""

    name = "torch"
    is_graph_safe = True  # no host sync: indexing and index_copy_ stay on the device

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        residual.add_(x)  # HF: hidden_states = residual + hidden_states, in the activation dtype
        return rms_norm(residual, weight, eps)

    def qk_norm_rope_kv(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos_sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        _, _, num_kv_heads, head_dim = k_cache.shape
        num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
        heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
        q, k, v = heads.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
        # HF casts cos/sin to the activation dtype before rotating.
        cos, sin = cos_sin[positions].to(qkv.dtype).chunk(2, dim=-1)  # [T, D/2] each
        q = apply_rope(rms_norm(q, q_weight, eps), cos, sin)  # [T, H, D]
        k = apply_rope(rms_norm(k, k_weight, eps), cos, sin)  # [T, KVH, D]
        flat = (-1, num_kv_heads, head_dim)  # slot-major view of the cache: [N * S, KVH, D]
        k_cache.view(flat).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(flat).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up  # HF's Qwen3MLP: act_fn(gate_proj(x)) * up_proj(x)

    def grouped_gemm(
        self, rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        return grouped_gemm(rows, weight, offsets)
