"""Limits of one prefill instance, built once from CLI flags and validated here."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class PrefillConfig:
    """How the prefill worker batches, chunks and bounds its work.

    `num_blocks` sizes this instance's own KV pool (the prompt's KV lives here from its first
    forward until decode acknowledges the transfer). `max_queued_tokens` bounds the prompt tokens
    admitted and not yet finished (queued, computing or transferring): it bounds both the queue
    and the KV held for in-flight transfers.
    """

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_queued_tokens: int = 4 * DEFAULT_MAX_BATCH_TOKENS
    # Longest wait for decode's acknowledgement, counted from accepting the prompt, when the
    # Prefill caller's deadline is later (or unset): a stuck decode cannot strand our blocks.
    transfer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_batch_tokens", "max_queued_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_batch_tokens < self.block_size:
            # Chunks of a long prompt end on block boundaries, so a forward must hold one block.
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= block_size "
                f"({self.block_size})"
            )
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
