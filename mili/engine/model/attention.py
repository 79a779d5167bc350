"""Attention backend interface over the paged KV cache, and its torch reference implementation.

The model calls its backend once per layer per step: `prefill` for packed variable-length prompt
chunks, `decode` for one new token per sequence. Arguments are plain tensors (no Python
objects, no per-sequence lists) so a compiled kernel (the Mojo backend) implements the same
`AttentionBackend` Protocol and the model cannot tell the difference.

Shapes (H = num_attention_heads, KVH = num_key_value_heads, D = head_dim, B = sequences,
T = packed new tokens of all sequences, N = num_blocks, S = block_size):

    q            [T, H, D]  (prefill) or [B, H, D] (decode)
    k, v         [T, KVH, D]  new tokens' keys/values (already RoPE'd and k-normed)
    k/v_cache    [N, S, KVH, D]  one layer of `KVCache`
    cu_seqlens   [B + 1] int32  sequence i's new tokens are q[cu_seqlens[i]:cu_seqlens[i+1]]
    start_positions [B] int32  tokens of sequence i already in the cache before this chunk
                    (the position of its first new token); 0 for a fresh prompt
    block_tables [B, max_blocks] int32  block ids per sequence, padded with any valid id
    seq_lens     [B] int32  (decode) tokens of each sequence in the cache, the new one included

Both calls are causal with grouped-query attention (H is a multiple of KVH; q head h reads kv head
h // (H // KVH), as HF's `repeat_kv`). Precondition of both: the caller has already written the
new tokens' K/V into the cache at their slots, so the cache holds positions
[0, start_position + n) of every sequence; a prefill backend may read the new tokens from `k`/`v`
or from the cache, whichever suits it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from mili.arith import ceil_div


class AttentionBackend(Protocol):
    """Causal GQA attention over packed prompt chunks (`prefill`) and the paged cache (`decode`)."""

    name: str
    # Whether `decode` may be captured in a CUDA graph and replayed: no host syncs, no
    # validation that reads values, allocations and launch grids that depend only on shapes
    # (the block table's full width, not the lengths in it), the same on every replay. The
    # engine captures decode steps only over a backend that says so (mili.engine.step.cuda_graphs).
    is_graph_safe: bool

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] -> out: [T, H, D] in q's dtype.

        Token j of sequence i (absolute position start_positions[i] + j) attends to positions
        [0, start_positions[i] + j] of that sequence: the cached prefix plus the new tokens up to
        itself. That covers chunked prefill and prefix reuse (start > 0) as well as fresh prompts.
        """
        ...

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """q: [B, H, D] (one query per sequence, the newest position) -> out: [B, H, D].

        Sequence i attends to positions [0, seq_lens[i]) read from its blocks.
        """
        ...


class TorchAttention:
    """Reference backend on `F.scaled_dot_product_attention`: any device and dtype torch supports.

    Not graph-safe: prefill's shapes follow the prompts, and decode gathers every block of the
    table's width (all of max context, in a graph) for every sequence.

    Correctness first: prefill loops over sequences (packed prompts have different lengths and
    prefixes, and a dense block-diagonal mask would cost T^2 memory); decode gathers every
    sequence's blocks into a padded `[B, KVH, max_blocks * S, D]` tensor and masks the tail.
    """

    name = "torch"
    is_graph_safe = False

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        start_positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        bounds = cu_seqlens.tolist()
        starts = start_positions.tolist()
        for i, start in enumerate(starts):
            lo, hi = bounds[i], bounds[i + 1]
            if hi == lo:
                continue
            q_i = q[lo:hi].transpose(0, 1)  # [H, n, D]
            k_i, v_i = k[lo:hi], v[lo:hi]  # [n, KVH, D]
            mask = None
            if start > 0:
                # Prepend the cached prefix (positions [0, start)) read from this sequence's blocks.
                num_blocks = ceil_div(start, block_size)
                blocks = block_tables[i, :num_blocks].long()
                k_prefix = k_cache[blocks].flatten(0, 1)[:start].to(q.dtype)  # [start, KVH, D]
                v_prefix = v_cache[blocks].flatten(0, 1)[:start].to(q.dtype)
                k_i, v_i = torch.cat((k_prefix, k_i)), torch.cat((v_prefix, v_i))
                # Causal with an offset: query j sits at position start + j. (SDPA's is_causal
                # aligns the diagonal top-left, which is wrong once keys outnumber queries.)
                context = start + hi - lo
                key_pos = torch.arange(context, device=q.device)
                query_pos = torch.arange(start, context, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]  # [n, context]
            o = F.scaled_dot_product_attention(
                q_i,
                k_i.transpose(0, 1),
                v_i.transpose(0, 1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )  # [H, n, D]
            out[lo:hi] = o.transpose(0, 1)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        num_seqs = q.shape[0]
        blocks = block_tables.long()
        # [B, max_blocks, S, KVH, D] -> [B, KVH, max_blocks * S, D]
        k = k_cache[blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
        v = v_cache[blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
        key_pos = torch.arange(k.shape[2], device=q.device)
        mask = key_pos[None, :] < seq_lens[:, None].to(q.device)  # [B, max_blocks * S]
        # Zero what the mask hides: a freed block keeps its last owner's values, and an inf or
        # NaN there would reach this sequence through the masked score (NaN) or 0 x V.
        hidden = ~mask[:, None, :, None]  # [B, 1, max_blocks * S, 1]
        k, v = k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [B, H, 1, D]
            k,
            v,
            attn_mask=mask.view(num_seqs, 1, 1, -1),
            scale=scale,
            enable_gqa=True,
        )  # [B, H, 1, D]
        return o[:, :, 0, :]
