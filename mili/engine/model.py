"""Qwen3 dense decoder in torch, over a paged KV cache: one code path for CPU and CUDA.

Module and parameter names are HF transformers' (`model.layers.3.self_attn.q_proj.weight`, ...),
so `model.named_parameters()` is the list of tensors a checkpoint must hold (`lm_head.weight` only
when embeddings are untied).

Two entry points, both `torch.inference_mode`, both returning float32 logits:

    prefill(PrefillBatch, kv_cache)  packed prompt chunks -> [B, vocab] (or [T, vocab])
    decode(DecodeBatch, kv_cache)    one token per sequence -> [B, vocab]

Per layer: x -> RMSNorm -> q/k/v proj -> per-head RMSNorm on q, k -> RoPE -> write K/V at
slot_mapping -> attention backend -> o_proj -> +x -> RMSNorm -> SwiGLU -> +residual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mili.engine.attention import AttentionBackend, TorchAttention
from mili.engine.config import Qwen3Config
from mili.engine.kv_cache import KVCache, slots_for_range
from mili.engine.layers import MLP, RMSNorm
from mili.engine.rope import RotaryEmbedding, apply_rope

# attend(q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]; one closure per layer and step.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


class SelfAttention(nn.Module):
    """Projections and per-head norms of Qwen3 attention; the attention itself is `attend`."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=bias)
        # Qwen3's QK-norm: RMSNorm over head_dim of every head, before RoPE.
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        num_tokens = x.shape[0]  # x: [T, hidden]
        q = self.q_norm(self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [T, H, D], [T, KVH, D]
        out = attend(q, k, v)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """The `model.` prefix of HF names: embeddings, decoder layers, final norm."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with a language-model head; build on `meta` and let the loader materialize weights."""

    def __init__(self, config: Qwen3Config, attention: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention if attention is not None else TorchAttention()
        self.model = Qwen3Model(config)
        # Tied: the head reuses embed_tokens.weight and no `lm_head.weight` exists, as in HF files.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config)
        self.scale = config.head_dim**-0.5
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
        [T, vocab], when `all_logits` (prompt logprobs). `layer_callback(i)` runs once layer i's
        K/V is in the cache, so a caller can start shipping it while layer i+1 computes.
        """

        def attend_fn(layer: int) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kv_cache.write(layer, batch.slot_mapping, k, v)
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

            return attend

        hidden = self._layers(batch.input_ids, batch.positions, attend_fn, layer_callback)
        if not all_logits:
            hidden = hidden[batch.cu_seqlens[1:].long() - 1]  # last token of each sequence
        return self._logits(hidden)

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, kv_cache: KVCache) -> torch.Tensor:
        """One step for B sequences: writes each new token's K/V, returns [B, vocab] float32."""

        def attend_fn(layer: int) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kv_cache.write(layer, batch.slot_mapping, k, v)
                return self.attention.decode(
                    q,
                    kv_cache.k[layer],
                    kv_cache.v[layer],
                    batch.block_tables,
                    batch.seq_lens,
                    scale=self.scale,
                )

            return attend

        return self._logits(self._layers(batch.input_ids, batch.positions, attend_fn, None))

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend_fn: Callable[[int], Attend],
        layer_callback: Callable[[int], None] | None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, D]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attend_fn(i))
            if layer_callback is not None:
                layer_callback(i)
        return self.model.norm(x)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()  # [N, vocab]
