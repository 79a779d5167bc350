"""Limits of one prefill instance, built once from CLI flags and validated here.

Torch-free: the parser's defaults come from here. The engine's flags (device, dtype, KV pool)
are the ones decode shares: mili.engine.engine_config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mili.arith import ceil_div
from mili.discovery import PeerSet
from mili.engine.engine_config import EngineConfig
from mili.kv_handoff.kv_transport import CHOICES as KV_TRANSPORTS

DEFAULT_MAX_BATCH_TOKENS = 2048


@dataclass(frozen=True)
class PrefillConfig:
    """How the prefill worker batches, chunks and bounds its work.

    `engine` sizes this instance's own KV pool among the rest (the prompt's KV lives here from
    its first forward until decode acknowledges the transfer). `max_queued_tokens` bounds the
    prompt tokens admitted and not yet finished (queued, computing or transferring): it bounds
    both the queue and the KV held for in-flight transfers, so the pool never needs more than
    `max_queued_blocks`.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_queued_tokens: int = 4 * DEFAULT_MAX_BATCH_TOKENS
    # Longest wait for decode's acknowledgement, counted from accepting the prompt, when the
    # Prefill caller's deadline is later (or unset): a stuck decode cannot strand our blocks.
    transfer_timeout_s: float = 60.0
    # The decode instances (host:port, as the frontend names them) this instance may send KV
    # to, as --decode gives them (mili.discovery.PeerSet.parse). A Prefill call names its
    # destination, and anyone who reaches our port can call Prefill: without this list we
    # would dial whatever it names. Empty: none; "*" alone: any. A dns:///NAME:PORT entry
    # allows every address NAME resolves to.
    allowed_decodes: tuple[str, ...] = ()
    # Reuse the KV of full blocks earlier prompts computed (mili.engine.kv.prefix_cache): a prompt
    # computes only what follows its longest cached prefix. Cached blocks no request holds are
    # evicted, least recently used first, when a prompt needs the room.
    prefix_caching: bool = True
    # How KV bytes may leave (mili.kv_handoff.kv_transport.CHOICES); each decode pair gets the
    # fastest both sides offer. host_id None: this host's (tests inject others).
    kv_transport: str = "auto"
    host_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_queued_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_batch_tokens < self.engine.block_size:
            # Chunks of a long prompt end on block boundaries, so a forward must hold one block.
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= block_size "
                f"({self.engine.block_size})"
            )
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}"
            )
        try:
            PeerSet.parse(self.allowed_decodes)  # the handoff's own set: checked here first
        except ValueError as e:
            raise ValueError(f"allowed decodes: {e}") from None

    @property
    def max_queued_blocks(self) -> int:
        """The queue bound's tokens in whole blocks: the pool's default size, and the most a
        pool sized from device memory gets (prompts that each round up to whole blocks may
        wait for blocks: the scheduler admits by memory too)."""
        return ceil_div(self.max_queued_tokens, self.engine.block_size)
