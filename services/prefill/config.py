"""Limits of one prefill instance, built once from CLI flags and validated here.

Torch-free: the parser's defaults come from here. The engine's flags (device, dtype, KV pool)
are the ones decode shares: mili.engine.engine_config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mili.arith import ceil_div
from mili.discovery import DNS_SCHEME, Target, parse_target
from mili.engine.engine_config import EngineConfig
from mili.kv_handoff.kv_transport import CHOICES as KV_TRANSPORTS

ANY_DECODE = "*"  # allows every destination: only for networks where every peer is trusted
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
    # to. A Prefill call names its destination, and anyone who reaches our port can call
    # Prefill: without this list we would dial whatever it names. Empty: none; ANY_DECODE: any.
    # A dns:///NAME:PORT entry allows every address NAME resolves to (`decode_names`).
    allowed_decodes: tuple[str, ...] = ()
    # Reuse the KV of full blocks earlier prompts computed (mili.engine.kv.prefix_cache): a prompt
    # computes only what follows its longest cached prefix. Cached blocks no request holds are
    # evicted, least recently used first, when a prompt needs the room.
    prefix_caching: bool = True
    # How KV bytes may leave (mili.kv_handoff.kv_transport.CHOICES); each decode pair gets the
    # fastest both sides offer. host_id None: this host's (tests inject others).
    kv_transport: str = "auto"
    host_id: str | None = None
    _allowed: frozenset[str] = field(init=False, repr=False, compare=False)
    _names: tuple[Target, ...] = field(init=False, repr=False, compare=False)

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
        allowed = set()
        names = []
        for address in self.allowed_decodes:
            if address.strip().lower().startswith(DNS_SCHEME):
                names.append(parse_target(address))  # ValueError says what is wrong
                continue
            normal = address.strip() if address.strip() == ANY_DECODE else normal_address(address)
            if normal is None:
                raise ValueError(f"allowed decode {address!r} is not host:port")
            allowed.add(normal)
        object.__setattr__(self, "_allowed", frozenset(allowed))
        object.__setattr__(self, "_names", tuple(names))

    @property
    def decode_names(self) -> tuple[Target, ...]:
        """The dns:/// entries of allowed_decodes: checked by looking the names up."""
        return self._names

    @property
    def max_queued_blocks(self) -> int:
        """The queue bound's tokens in whole blocks: the pool's default size, and the most a
        pool sized from device memory gets (prompts that each round up to whole blocks may
        wait for blocks: the scheduler admits by memory too)."""
        return ceil_div(self.max_queued_tokens, self.engine.block_size)

    def may_send_to(self, address: str) -> bool:
        """Whether KV may go to `address` (compared as host:port, host case-insensitive), by
        the fixed entries alone (`decode_names` are looked up by the caller)."""
        if ANY_DECODE in self._allowed:
            return True
        normal = normal_address(address)
        return normal is not None and normal in self._allowed


def normal_address(address: str) -> str | None:
    """`host:port` in one spelling (host lower-cased, port without leading zeros), or None when
    `address` is not host:port with a port in 1..65535."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return f"{host.lower()}:{int(port)}"


def parse_allowed_decodes(values: Iterable[str]) -> tuple[str, ...]:
    """`--decode` values (each comma-separated) as one tuple, blanks dropped."""
    return tuple(a.strip() for v in values for a in v.split(",") if a.strip())
