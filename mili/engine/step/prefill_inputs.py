"""A prefill step's inputs in static device buffers, for the prefill graphs (prefill_graphs.py).

A CUDA graph replays fixed addresses and shapes, so a step of B <= S sequences and T tokens
runs at a padded token count T' >= T (a captured size) and always S sequence rows:

    tokens     [3, N] int64     rows: input_ids, positions, slot_mapping (N = the largest T')
    seqs       [S + 1 + S + S W] int32, one buffer: cu_seqlens [S + 1], start_positions [S],
                                block_tables [S, W] (W: the widest block table a request has)

Padding, so that it reads and writes only the null block (never handed out: block_pool.py):
tokens [T, T') are token 0 at position 0 in the null block's slot 0 and belong to no sequence
(cu_seqlens stops at T: attention leaves their rows alone, every other op is row by row, and
their K/V land in the null block); sequences [B, S) have no tokens (cu_seqlens repeats T), start
0 and a table of null blocks. Each chunk's last-token row is then cu_seqlens[i + 1] - 1, as
eagerly; a padded sequence's (T - 1, or the last row when T = 0) is computed and never read.

The host writes pinned mirrors (numpy views) and enqueues one copy per buffer; a mirror is
rewritten only once an event says its last copy ran.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mili.engine.model.qwen3 import PrefillBatch


class PrefillInputs:
    """Static prefill inputs for up to `max_tokens` tokens of up to `max_seqs` sequences."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        width: int,
        block_size: int,
        null_block_id: int,
        device: torch.device,
    ) -> None:
        if max_tokens <= 0 or max_seqs <= 0 or width <= 0:
            raise ValueError(f"max_tokens {max_tokens}, max_seqs {max_seqs}, width {width}")
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.width = width
        self.block_size = block_size
        self.null_block_id = null_block_id
        self.device = device
        pin = device.type == "cuda"
        seq_words = 2 * max_seqs + 1 + max_seqs * width
        self._tokens_host = torch.zeros((3, max_tokens), dtype=torch.int64, pin_memory=pin)
        self._seqs_host = torch.zeros(seq_words, dtype=torch.int32, pin_memory=pin)
        self._copied: torch.cuda.Event | None = None
        self.tokens = torch.zeros((3, max_tokens), dtype=torch.int64, device=device)
        self.seqs = torch.zeros(seq_words, dtype=torch.int32, device=device)

    def fill(
        self,
        token_ids: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        start_positions: Sequence[int],
        num_tokens: int,
    ) -> None:
        """Stage chunk i (`token_ids[i]` at positions start_positions[i] + 0, 1, ... of a request
        whose `block_tables[i]` covers them) padded to `num_tokens` tokens and `max_seqs`
        sequences, and enqueue the copies."""
        n = len(token_ids)
        total = sum(len(chunk) for chunk in token_ids)
        if not (n <= self.max_seqs and total <= num_tokens <= self.max_tokens):
            raise ValueError(
                f"{n} chunks of {total} tokens padded to {num_tokens}: at most "
                f"{self.max_seqs} chunks and {self.max_tokens} tokens"
            )
        if any(len(table) > self.width for table in block_tables):
            raise ValueError(f"a block table is wider than {self.width} blocks")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies read the mirrors: long done
        null = self.null_block_id
        # The chunks' own tokens, positions, slots and sequence bounds, as an eager step has them
        built = PrefillBatch.build(
            token_ids, block_tables, self.block_size, start_positions=start_positions
        )
        tokens = self._tokens_host.numpy()  # [3, N]
        tokens[0, :total] = built.input_ids.numpy()
        tokens[1, :total] = built.positions.numpy()
        tokens[2, :total] = built.slot_mapping.numpy()
        tokens[0:2, total:num_tokens] = 0
        tokens[2, total:num_tokens] = null * self.block_size
        s = self.max_seqs
        words = self._seqs_host.numpy()
        cu, starts = words[: s + 1], words[s + 1 : 2 * s + 1]
        tables = words[2 * s + 1 :].reshape(s, self.width)
        cu[: n + 1] = built.cu_seqlens.numpy()
        cu[n + 1 :] = total
        starts[:n] = built.start_positions.numpy()
        starts[n:] = 0
        tables[:] = null
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        self.tokens.copy_(self._tokens_host, non_blocking=True)
        self.seqs.copy_(self._seqs_host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))

    def batch(self, num_tokens: int) -> PrefillBatch:
        """The model's PrefillBatch over tokens [0, num_tokens) and all `max_seqs` rows (views)."""
        s = self.max_seqs
        return PrefillBatch(
            input_ids=self.tokens[0, :num_tokens],
            positions=self.tokens[1, :num_tokens],
            cu_seqlens=self.seqs[: s + 1],
            start_positions=self.seqs[s + 1 : 2 * s + 1],
            block_tables=self.seqs[2 * s + 1 :].view(s, self.width),
            slot_mapping=self.tokens[2, :num_tokens],
        )
