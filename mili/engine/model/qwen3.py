"""Qwen3 decoder in torch, over a paged KV cache: one code path for CPU and CUDA.

Dense and mixture-of-experts (Qwen3-MoE) alike: they differ only in the MLP of a sparse layer
(`config.is_sparse_layer(i)`: a router and grouped experts, mili/engine/model/moe.py, in place
of the SwiGLU MLP), so attention, the KV cache and everything that moves it are shared.

Module names are HF transformers' (`model.layers.3.self_attn.o_proj.weight`, ...) except where
projections are merged into one GEMM (`self_attn.qkv_proj` holds q_proj/k_proj/v_proj,
`mlp.gate_up_proj` holds gate_proj/up_proj); mili/engine/model/weight_map.py maps every HF tensor
name to its parameter and rows, and is the list of tensors a checkpoint must hold (`lm_head.weight`
only when embeddings are untied).

Two entry points, both `torch.inference_mode`, both returning float32 logits:

    prefill(PrefillBatch, kv_cache)  packed prompt chunks -> [B, vocab] (or [T, vocab])
                                     (prefill_hidden + logits: the same, in two parts)
    decode(DecodeBatch, kv_cache)    one token per sequence -> [B, vocab]

Per layer, each line one kernel or two where the FusedOps are fused (mili/engine/model/
fused_ops.py; at decode's batch sizes the GPU's gemv kernels make each line one kernel):

    qkv = RMSNorm(residual += x) @ W_qkv    add_rms_norm_linear: q | k | v projections
    q, k, v = qk_norm_rope_kv(qkv)          per-head RMSNorm, RoPE, K/V into the cache
    o = attention(q, cache) @ W_o           attention backend, o_proj
    gate_up = RMSNorm(residual += o) @ W_gate_up
    x = silu_mul(gate_up) @ W_down          SwiGLU: silu_mul_linear (a sparse layer: the norm
                                            alone, then route h, grouped experts)

The residual stream is carried as (x, residual): x the last sublayer's output, residual the sum
before it, so each residual add fuses with the norm after it (the last with the final norm).
Nothing in a step reads a device tensor back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mili.engine.model.attention import AttentionBackend, TorchAttention
from mili.engine.model.config import Qwen3Config
from mili.engine.model.fused_ops import FusedOps, TorchFusedOps
from mili.engine.model.kv_cache import KVCache, slots_for_range
from mili.engine.model.layers import MLP, MergedLinear, RMSNorm
from mili.engine.model.moe import SparseMoeBlock
from mili.engine.model.rope import RotaryEmbedding

# attend(layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]: one closure per step.
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PrefillBatch(NamedTuple):
    """Packed prompt chunks of B sequences (T new tokens in all); see attention.py for shapes."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    cu_seqlens: torch.Tensor  # [B + 1] int32
    start_positions: torch.Tensor  # [B] int32, tokens already cached per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    slot_mapping: torch.Tensor  # [T] int64

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        *,
        start_positions: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> PrefillBatch:
        """Sequence i's chunk `token_ids[i]` sits at positions start_positions[i] + 0, 1, ...

        `block_tables[i]` must already cover every one of those positions.
        """
        starts = list(start_positions) if start_positions is not None else [0] * len(token_ids)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        for chunk, start, table in zip(token_ids, starts, block_tables, strict=True):
            end = start + len(chunk)
            ids.extend(chunk)
            positions.extend(range(start, end))
            slots.extend(slots_for_range(table, start, end, block_size))
            cu_seqlens.append(len(ids))
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            start_positions=torch.tensor(starts, dtype=torch.int32, device=device),
            block_tables=_pad_block_tables(block_tables, device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )


class DecodeBatch(NamedTuple):
    """One new token per sequence, at `positions` (= tokens already cached)."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [B] int32, = positions + 1
    slot_mapping: torch.Tensor  # [B] int64

    @classmethod
    def build(
        cls,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        *,
        device: torch.device | str = "cpu",
    ) -> DecodeBatch:
        slots = [
            table[p // block_size] * block_size + p % block_size
            for p, table in zip(positions, block_tables, strict=True)
        ]
        return cls(
            input_ids=torch.tensor(list(token_ids), dtype=torch.int64, device=device),
            positions=torch.tensor(list(positions), dtype=torch.int64, device=device),
            block_tables=_pad_block_tables(block_tables, device),
            seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )


def _pad_block_tables(
    block_tables: Sequence[Sequence[int]], device: torch.device | str
) -> torch.Tensor:
    width = max((len(t) for t in block_tables), default=0)
    rows = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), width)


class _Step(NamedTuple):
    """What every layer of one prefill or decode call shares."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cos_sin: torch.Tensor  # [max_context_tokens, head_dim] float32 (rope.py)
    kv_cache: KVCache
    attend: Attend
    ops: FusedOps


class SelfAttention(nn.Module):
    """Projections and per-head norms of Qwen3 attention; the attention itself is `step.attend`."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        # q, k and v as one GEMM: output columns [q: H*D | k: KVH*D | v: KVH*D].
        self.qkv_proj = MergedLinear(
            hidden,
            {
                "q_proj": self.num_heads * d,
                "k_proj": self.num_kv_heads * d,
                "v_proj": self.num_kv_heads * d,
            },
            bias=bias,
        )
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        # Qwen3's QK-norm: RMSNorm over head_dim of every head, before RoPE.
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, qkv: torch.Tensor, step: _Step, layer: int) -> torch.Tensor:
        """qkv: [T, (H + 2 KVH) * D], the normed input's projection (DecoderLayer makes it
        with the norm, one kernel on the GPU's gemv) -> o_proj's output [T, hidden]."""
        num_tokens = qkv.shape[0]
        ops, o_proj = step.ops, self.o_proj
        q, k, v = ops.qk_norm_rope_kv(
            qkv,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            step.cos_sin,
            step.positions,
            step.slot_mapping,
            step.kv_cache.k[layer],
            step.kv_cache.v[layer],
        )  # q: [T, H, D]; k, v: [T, KVH, D], already in the cache
        out = step.attend(layer, q, k, v)  # [T, H, D]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return ops.linear(out, o_proj.weight, o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer: int) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.mlp: MLP | SparseMoeBlock
        if config.is_sparse_layer(layer):
            self.mlp = SparseMoeBlock(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
            )
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: _Step, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual) of the next layer; x, residual: [T, hidden].

        HF's layer is `r = x + attn(norm1(x)); x = r + mlp(norm2(r))`; here the pending add of
        the previous sublayer happens inside the next norm. residual is None on layer 0, whose
        x is the embeddings.
        """
        ops, norm, qkv_proj = step.ops, self.input_layernorm, self.self_attn.qkv_proj
        qkv, residual = ops.add_rms_norm_linear(
            x, residual, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias
        )
        x = self.self_attn(qkv, step, layer)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, MLP):
            gate_up_proj, down_proj = self.mlp.gate_up_proj, self.mlp.down_proj
            gate_up, residual = ops.add_rms_norm_linear(
                x, residual, norm.weight, norm.eps, gate_up_proj.weight, None
            )
            return ops.silu_mul_linear(gate_up, down_proj.weight), residual
        h = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class Qwen3Model(nn.Module):
    """The `model.` prefix of HF names: embeddings, decoder layers, final norm."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with a language-model head; build on `meta` and let the loader materialize weights.

    `attention` and `fused_ops` are the kernels it runs on (torch references by default);
    services choose them once at start-up (kernels/backend.py).
    """

    def __init__(
        self,
        config: Qwen3Config,
        attention: AttentionBackend | None = None,
        fused_ops: FusedOps | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention if attention is not None else TorchAttention()
        self.fused_ops: FusedOps = fused_ops if fused_ops is not None else TorchFusedOps()
        self.model = Qwen3Model(config)
        # Tied: the head reuses embed_tokens.weight and no `lm_head.weight` exists, as in HF files.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config)
        self.scale = config.head_dim**-0.5
        # Ids that end a generation: config.json's eos_token_id here; the loader replaces them
        # with generation_config.json's when the checkpoint has one (loader.eos_token_ids).
        eos = config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or ()))
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.inference_mode()
    def prefill(
        self,
        batch: PrefillBatch,
        kv_cache: KVCache,
        *,
        all_logits: bool = False,
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run packed prompt chunks, writing their K/V into `kv_cache`.

        Returns float32 logits of each sequence's last token, [B, vocab], or of every token,
        [T, vocab], when `all_logits`. `layer_callback(i)` runs once layer i's K/V is in the
        cache, so a caller can start shipping it while layer i+1 computes.
        """
        hidden = self.prefill_hidden(batch, kv_cache, layer_callback=layer_callback)
        if not all_logits:
            hidden = hidden[batch.cu_seqlens[1:].long() - 1]  # last token of each sequence
        return self.logits(hidden)

    @torch.inference_mode()
    def prefill_hidden(
        self,
        batch: PrefillBatch,
        kv_cache: KVCache,
        *,
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`prefill` up to the final norm: every token's hidden state [T, hidden], from which
        `logits` makes the rows a caller wants (prompt logprobs take them a slice at a time)."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attention.prefill(
                q,
                k,
                v,
                batch.cu_seqlens,
                batch.start_positions,
                kv_cache.k[layer],
                kv_cache.v[layer],
                batch.block_tables,
                scale=self.scale,
            )

        step = self._step(batch.positions, batch.slot_mapping, kv_cache, attend)
        return self._layers(batch.input_ids, step, layer_callback)

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, kv_cache: KVCache) -> torch.Tensor:
        """One step for B sequences: writes each new token's K/V, returns [B, vocab] float32."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attention.decode(
                q,
                kv_cache.k[layer],
                kv_cache.v[layer],
                batch.block_tables,
                batch.seq_lens,
                scale=self.scale,
            )

        step = self._step(batch.positions, batch.slot_mapping, kv_cache, attend)
        return self.logits(self._layers(batch.input_ids, step, None))

    def _step(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: KVCache,
        attend: Attend,
    ) -> _Step:
        cos_sin = self.rotary.cos_sin_table(positions.device)
        return _Step(positions, slot_mapping, cos_sin, kv_cache, attend, self.fused_ops)

    def _layers(
        self,
        input_ids: torch.Tensor,
        step: _Step,
        layer_callback: Callable[[int], None] | None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, step, i)
            if layer_callback is not None:
                layer_callback(i)
        norm = self.model.norm
        if residual is None:  # no layers
            return step.ops.rms_norm(x, norm.weight, norm.eps)
        return step.ops.add_rms_norm(x, residual, norm.weight, norm.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (after the final norm) -> float32 logits [N, vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()  # [N, vocab]
