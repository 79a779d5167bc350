"""The decode step's inputs in static device buffers, filled from pinned host mirrors.

A CUDA graph replays fixed addresses, so every step's inputs live in buffers allocated once,
for `max_rows` sequences (R) and the widest block table a request can have (W blocks):

    scalars       [6, R] int64   rows: input_ids, positions, seq_lens, slot_mapping, and the
                                 rows fed from the previous step's sampled ids (row, source)
    seq_lens      [R] int32      scalars[2] as the attention kernels want it (a copy in the step)
    block_tables  [R, W] int32   row r: its request's block_table, then the null block

Each step writes its rows into a pinned host mirror (numpy views of it, no torch calls per
row) and enqueues non-blocking copies: all of `scalars` (a few KiB), and of `block_tables` only
the rows whose request changed or whose table grew (BlockTableRows). A row "ahead" feeds the
token the previous step sampled for it, which the host has not seen yet: its position is one
past what the host knows, and its input id is gathered on the device from that step's ids
(two small launches, in stream order after the copies). Two mirror sets
alternate, so the host fills step n+1's while step n's copies may still be queued (a set is
rewritten only once an event says its last copies ran; normally long done). Rows beyond
the batch, up to the padded size a CUDA graph runs at, are padding: token 0 at position 0,
seq_len 1, slot and block table on the null block (never handed out: block_pool.py), so they
read and write only the null block.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from mili.engine.kv.block_table_rows import BlockTableRows
from mili.engine.model.qwen3 import DecodeBatch
from mili.engine.step.pinned import is_pinnable
from mili.engine.step.sequence import Sequence

_INPUT_IDS, _POSITIONS, _SEQ_LENS, _SLOTS, _AHEAD_ROWS, _AHEAD_SOURCES = range(6)


class DecodeInputs:
    """Static decode-step inputs for up to `max_rows` sequences; see the module docstring."""

    def __init__(
        self,
        max_rows: int,
        width: int,
        block_size: int,
        null_block_id: int,
        device: torch.device,
    ) -> None:
        self.max_rows = max_rows
        self.width = width
        self.block_size = block_size
        self.null_block_id = null_block_id
        self.device = device
        pin = is_pinnable(device)
        # Host: two mirror sets of the scalars and of the block-table rows to copy.
        self._scalars_host = [
            torch.zeros((6, max_rows), dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._rows_host = [
            torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._tables_host = [
            torch.zeros((max_rows, width), dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._flip = 0
        self._copied: list[torch.cuda.Event | None] = [None, None]  # per set, CUDA only
        # What the device's block_tables holds, row for row (the mirror BlockTableRows tracks).
        self.block_tables_host = np.full((max_rows, width), null_block_id, dtype=np.int32)
        self._rows = BlockTableRows(max_rows, width)
        # Device.
        self.scalars = torch.zeros((6, max_rows), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (max_rows, width), null_block_id, dtype=torch.int32, device=device
        )
        self._changed_rows = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._changed_tables = torch.zeros((max_rows, width), dtype=torch.int32, device=device)

    def fill(
        self,
        seqs: Seq[Sequence],
        num_rows: int,
        sources: Seq[int] | None = None,
        sampled: torch.Tensor | None = None,
    ) -> int:
        """Stage a step of `seqs` padded to `num_rows` rows and enqueue its copies.

        Sequence i feeds its newest token at position num_tokens - 1, or, when `sources[i]`
        >= 0, the token `sampled[sources[i]]` (the previous step's ids [B'] int64 on the
        device, not on the host yet) at position num_tokens; its block_table must cover that
        position. Returns the blocks the longest sequence reads (an eager step's block-table
        width).
        """
        n = len(seqs)
        if not n <= num_rows <= self.max_rows:
            raise ValueError(f"{n} sequences padded to {num_rows} rows; at most {self.max_rows}")
        k, self._flip = self._flip, self._flip ^ 1
        copied = self._copied[k]
        if copied is not None and not copied.query():
            copied.synchronize()  # the set's previous copies are still queued: rare
        scalars_host, rows_host, tables_host = (
            self._scalars_host[k],
            self._rows_host[k],
            self._tables_host[k],
        )

        size = self.block_size
        if sources is None:
            sources = [-1] * n
        ids, positions, slots, ahead = [], [], [], []
        for row, (seq, source) in enumerate(zip(seqs, sources, strict=True)):
            position = seq.num_tokens - 1
            if source >= 0:
                position += 1
                ahead.append(row)
            ids.append(seq.output_token_ids[-1])  # an ahead row's is replaced on the device
            positions.append(position)
            slots.append(seq.block_table[position // size] * size + position % size)
        host = scalars_host.numpy()  # [6, R]: shares the (pinned) memory
        host[_INPUT_IDS, :n] = ids
        host[_POSITIONS, :n] = positions
        host[_SEQ_LENS, :n] = host[_POSITIONS, :n] + 1
        host[_SLOTS, :n] = slots
        host[_INPUT_IDS, n:num_rows] = 0
        host[_POSITIONS, n:num_rows] = 0
        host[_SEQ_LENS, n:num_rows] = 1
        host[_SLOTS, n:num_rows] = self.null_block_id * size
        m = len(ahead)
        if m:
            if sampled is None:
                raise ValueError("rows ahead of the host need the previous step's sampled ids")
            host[_AHEAD_ROWS, :m] = ahead
            host[_AHEAD_SOURCES, :m] = [sources[row] for row in ahead]
        self.scalars.copy_(scalars_host, non_blocking=True)
        if m:
            assert sampled is not None
            gathered = sampled.index_select(0, self.scalars[_AHEAD_SOURCES, :m])
            self.scalars[_INPUT_IDS].index_copy_(0, self.scalars[_AHEAD_ROWS, :m], gathered)

        tables: list[list[int] | None] = [seq.block_table for seq in seqs]
        tables += [None] * (num_rows - n)
        changed = self._rows.update(tables)
        if changed:
            mirror = self.block_tables_host
            for row in changed:
                table = tables[row]
                mirror[row] = self.null_block_id
                if table:
                    mirror[row, : len(table)] = table
            m = len(changed)
            rows_host.numpy()[:m] = changed
            tables_host.numpy()[:m] = mirror[changed]
            self._changed_rows[:m].copy_(rows_host[:m], non_blocking=True)
            self._changed_tables[:m].copy_(tables_host[:m], non_blocking=True)
            self.block_tables.index_copy_(0, self._changed_rows[:m], self._changed_tables[:m])
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[k] = event
        return max(positions) // size + 1 if positions else 1

    def batch(self, num_rows: int, width: int | None = None) -> DecodeBatch:
        """The model's DecodeBatch over rows [0, num_rows) of the buffers (views, plus the
        seq_lens conversion, a device op: inside a captured graph it is replayed too).

        `width`: cut the block tables to that many columns (a contiguous copy), for eager
        steps; None keeps all W, as a graph does.
        """
        self.seq_lens[:num_rows].copy_(self.scalars[_SEQ_LENS, :num_rows])
        block_tables = self.block_tables[:num_rows]
        if width is not None and width < self.width:
            block_tables = block_tables[:, :width].contiguous()
        return DecodeBatch(
            input_ids=self.scalars[_INPUT_IDS, :num_rows],
            positions=self.scalars[_POSITIONS, :num_rows],
            block_tables=block_tables,
            seq_lens=self.seq_lens[:num_rows],
            slot_mapping=self.scalars[_SLOTS, :num_rows],
        )
