"""The batch token mask: filled on the CPU from the rows' matchers, applied to the logits.

A mask row is ceil(vocab_rows / 32) int32 words; bit j of word w allows token 32*w + j
(little-endian, as llguidance and xgrammar write it). Padded model rows (past the tokenizer)
and every token the grammar forbids have their bit clear; EOS ids are allowed exactly when the
grammar can end here.

    step k:  masker.start(matchers)  ──▶ a fill thread: bitmask rows of the constrained rows
             device step k (forward)      ...runs meanwhile (GIL released on both sides)
             pending.result()            the FilledMask (None when no row is constrained)
             sampler.launch(logits, seqs, mask)  logits[row, token] = -inf where the bit is 0,
                                         before penalties, temperature and top-k/p
             matcher.accept(token) per constrained row (Sequence.append)

Rows whose request has no constraint are neither filled nor touched, and a batch without any
constraint costs one scan of a Python list: no thread hop, no mask tensor.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from mili.engine.constraint.matcher import ConstraintMatcher
    from mili.engine.constraint.vocab import GrammarTokenizer


def decode_mask_threads() -> int:
    """llguidance threads (and compile lanes) filling a decode step's masks: half the cores,
    1 to 4 (4 filled a Qwen3-sized batch of 64 faster than 8 on a 16-core GPU host:
    docs/benchmarks.md, "Structured output on a GPU")."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class FilledMask(NamedTuple):
    """The masks of one step: `bitmask[i]` belongs to batch row `row_ids[i]`."""

    bitmask: torch.Tensor  # [num_constrained, num_mask_words] int32, CPU
    row_ids: list[int]


class BatchMasker:
    """Fills the masks of a batch's constrained rows, in parallel on llguidance's own threads
    (the GIL is released), into one reused CPU buffer (pinned when CUDA is there, so the copy
    to the device can overlap). `start` runs the fill on a thread of its own, so the caller can
    launch the device step meanwhile. One step driver owns it: a fill writes the buffer the
    previous step's mask was read from, so it starts only once that step's sample is back."""

    def __init__(self, tokenizer: GrammarTokenizer, max_batch: int, num_threads: int = 1):
        # Imported here, not at the top: the sampler imports this module, and a model runner
        # that serves no constraint then runs where llguidance is missing (a GPU image that
        # lacks the wheel still runs every engine check).
        import llguidance

        self.tokenizer = tokenizer
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._pin = torch.cuda.is_available()
        self._buffer = self._new_buffer(max_batch)
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None
        ids = np.array(tokenizer.special_ids, dtype=np.int64)
        # (ids, their mask words, their bits in them), for _mend; None: no special tokens
        self._specials = (
            (ids, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32))) if len(ids) else None
        )

    def _new_buffer(self, num_rows: int) -> torch.Tensor:
        words = self.tokenizer.num_mask_words
        return torch.zeros((max(1, num_rows), words), dtype=torch.int32, pin_memory=self._pin)

    def fill(self, matchers: Sequence[ConstraintMatcher | None]) -> FilledMask | None:
        """Masks for the rows whose matcher is not None; None when no row has one."""
        row_ids = [i for i, m in enumerate(matchers) if m is not None]
        if not row_ids:
            return None
        return self._fill(matchers, row_ids)

    def start(
        self, matchers: Sequence[ConstraintMatcher | None]
    ) -> concurrent.futures.Future[FilledMask] | None:
        """`fill` on the masker's thread; None (no thread hop) when no row is constrained.
        The matchers must not advance until the future is done."""
        row_ids = [i for i, m in enumerate(matchers) if m is not None]
        if not row_ids:
            return None
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, "constraint-mask")
        return self._filler.submit(self._fill, list(matchers), row_ids)

    def _fill(self, matchers: Sequence[ConstraintMatcher | None], row_ids: list[int]) -> FilledMask:
        if len(row_ids) > self._buffer.shape[0]:
            self._buffer = self._new_buffer(len(row_ids))
        # Rows in lane order: llguidance splits the list into contiguous runs over its threads,
        # and the rows of one lane would only wait for one another on two threads.
        order = sorted(range(len(row_ids)), key=lambda i: matchers[row_ids[i]].lane)  # type: ignore[union-attr]
        pairs = [(matchers[row_ids[i]].ll, i) for i in order]  # type: ignore[union-attr]
        bitmask = self._buffer[: len(row_ids)]
        words = self.tokenizer.num_mask_words
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(pairs))
        self._mend(bitmask, [matchers[row] for row in row_ids])  # type: ignore[misc]
        return FilledMask(bitmask, row_ids)

    def _mend(self, bitmask: torch.Tensor, matchers: Sequence[ConstraintMatcher]) -> None:
        """Clear the special tokens llguidance's mask offers but its matcher refuses, and
        allow the forced text spelled in plain pieces instead (matcher.spelled_alternative).
        Costs a look at the special tokens' few words per row; a validation only where one of
        their bits is set (EOS where the grammar can end, a token a grammar names). A row left
        empty is a grammar at a dead end: its draw is refused, as matcher.dead_end says."""
        specials = self._specials
        if specials is None:
            return
        ids, words, bits = specials
        rows = bitmask.numpy().view(np.uint32)  # [n, num_mask_words], shares memory
        for i, j in zip(*np.nonzero(rows[:, words] & bits), strict=True):
            matcher = matchers[i]
            if matcher.allowed(int(ids[j])):
                continue
            rows[i, words[j]] &= ~bits[j]
            spelled = matcher.spelled_alternative()
            if spelled is not None:
                rows[i, spelled // 32] |= np.uint32(1 << (spelled % 32))

    def close(self) -> None:
        if self._filler is not None:
            self._filler.shutdown(wait=False)


def unpack_bitmask(bitmask: torch.Tensor, vocab_rows: int) -> torch.Tensor:
    """[n, words] int32 -> [n, vocab_rows] bool (True = allowed), on the bitmask's device.
    One byte per token in between (the int32 words read as little-endian bytes)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [n, words * 4]
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [n, words * 4, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_rows].bool()


def apply_token_bitmask(logits: torch.Tensor, mask: FilledMask | None) -> None:
    """In place: -inf where a constrained row's mask forbids the token. logits: [B, V] with
    V <= vocab_rows (a view of the first columns is fine), on any device (the mask follows
    it); rows without a constraint are untouched."""
    if mask is None:
        return
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        _apply_numpy(logits, mask)
    else:
        _apply_torch(logits, mask)


# numpy's unpackbits + copyto(where=) beat torch's shifts + masked_fill_ 2-10x on the CPU
# (64 rows x 151,936: 2.5-10 ms against 15-20 ms; docs/benchmarks.md, "Structured output").
_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


def _apply_numpy(logits: torch.Tensor, mask: FilledMask) -> None:
    as_bytes = mask.bitmask.numpy().view(np.uint8)  # [n, words * 4]
    forbidden = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, : logits.shape[1]] == 0
    out = logits.detach().numpy()  # shares memory with logits
    if mask.row_ids == list(range(len(mask.row_ids))):
        np.copyto(out[: len(mask.row_ids)], -np.inf, where=forbidden)
        return
    for i, row in enumerate(mask.row_ids):
        np.copyto(out[row], -np.inf, where=forbidden[i])


def _apply_torch(logits: torch.Tensor, mask: FilledMask) -> None:
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [n, V]
    if mask.row_ids == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    # through pinned memory: a copy from pageable memory would wait for the device
    pinned = torch.tensor(mask.row_ids, dtype=torch.int64, pin_memory=logits.is_cuda)
    rows = pinned.to(logits.device, non_blocking=True)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
