"""Per-request grammar state, and the batch token mask applied to logits.

A mask row is ceil(vocab_rows / 32) int32 words; bit j of word w allows token 32*w + j
(little-endian, as llguidance and xgrammar write it). Padded model rows (past the tokenizer)
and every token the grammar forbids have their bit clear; EOS ids are allowed exactly when the
grammar can end here.

    step k:  BatchMasker.fill(matchers)  ──▶  bitmask rows of the constrained requests (CPU)
             apply_token_bitmask(logits, mask)  logits[row, token] = -inf where the bit is 0
             sample; then matcher.accept(token) for each constrained row

Rows whose request has no constraint are neither filled nor touched, and a batch without any
constraint costs one scan of a Python list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import llguidance
import numpy as np
import torch

if TYPE_CHECKING:
    from mili.engine.constraint.vocab import GrammarTokenizer


class ConstraintMatcher:
    """One request's position in its grammar. Not thread-safe: one step driver owns it."""

    def __init__(self, ll_matcher: Any, tokenizer: GrammarTokenizer) -> None:
        self._m = ll_matcher  # llguidance.LLMatcher
        self.tokenizer = tokenizer
        self.num_accepted = 0

    @property
    def ll(self) -> Any:
        """The llguidance.LLMatcher (for BatchMasker)."""
        return self._m

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row`: a contiguous CPU int32 tensor of
        tokenizer.num_mask_words words."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError("a mask row is a contiguous CPU int32 tensor")
        if row.numel() != self.tokenizer.num_mask_words:
            raise ValueError(
                f"mask row of {row.numel()} words, not {self.tokenizer.num_mask_words}"
            )
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def allowed(self, token_id: int) -> bool:
        """Whether `token_id` may come next (without advancing)."""
        if not 0 <= token_id < self.tokenizer.num_tokens or self._m.is_error():
            return False
        if self._m.is_stopped():  # a finished match takes EOS (llguidance refuses it here)
            return token_id in self.tokenizer.eos_token_ids
        return int(self._m.validate_tokens([token_id])) == 1

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token. False (and the matcher in its error state) when the
        grammar forbids it, which a masked sample never is."""
        if not self.allowed(token_id):
            return False
        if self._m.is_stopped():
            return True  # EOS after a finished match: nothing left to advance
        ok = bool(self._m.consume_token(token_id))
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts, a retried step)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if not self._m.rollback(num_tokens):
            raise RuntimeError(f"rollback failed: {self._m.get_error()}")
        self.num_accepted -= num_tokens

    @property
    def can_finish(self) -> bool:
        """The output so far is a complete match: EOS is allowed now."""
        return bool(self._m.is_accepting())

    @property
    def is_finished(self) -> bool:
        """Nothing more may follow (the match is complete and cannot extend, or EOS was
        accepted): the generation stops here with finish reason `stop`."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    @property
    def error(self) -> str:
        """Why the matcher is in its error state ('' when it is not)."""
        return str(self._m.get_error())


class FilledMask(NamedTuple):
    """The masks of one step: `bitmask[i]` belongs to batch row `row_ids[i]`."""

    bitmask: torch.Tensor  # [num_constrained, num_mask_words] int32, CPU
    row_ids: list[int]


class BatchMasker:
    """Fills the masks of a batch's constrained rows, in parallel on llguidance's own threads
    (the GIL is released), into one preallocated CPU buffer (pinned when CUDA is there, so
    the copy to the device can overlap)."""

    def __init__(self, tokenizer: GrammarTokenizer, max_batch: int, num_threads: int = 1):
        self.tokenizer = tokenizer
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        pin = torch.cuda.is_available()
        self._buffer = torch.zeros(
            (max_batch, tokenizer.num_mask_words), dtype=torch.int32, pin_memory=pin
        )

    def fill(self, matchers: Sequence[ConstraintMatcher | None]) -> FilledMask | None:
        """Masks for the rows whose matcher is not None; None when no row has one."""
        row_ids = [i for i, m in enumerate(matchers) if m is not None]
        if not row_ids:
            return None
        if len(row_ids) > self._buffer.shape[0]:
            raise ValueError(f"{len(row_ids)} constrained rows > max_batch {self._buffer.shape[0]}")
        pairs = [(matchers[row].ll, i) for i, row in enumerate(row_ids)]  # type: ignore[union-attr]
        bitmask = self._buffer[: len(row_ids)]
        words = self.tokenizer.num_mask_words
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(pairs))
        return FilledMask(bitmask, row_ids)


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
    rows = torch.tensor(mask.row_ids, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
