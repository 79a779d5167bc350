"""The decode service's configuration: one frozen dataclass, built once from CLI flags.

Torch-free on purpose: `mili --help` builds every service's parser, and the parser's defaults
come from here. The engine's flags (device, dtype, KV pool, CUDA graphs) are the ones prefill
shares: mili.engine.engine_config.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from mili import flags
from mili.engine.engine_config import EngineConfig, add_engine_arguments
from mili.kv_handoff.kv_transport import CHOICES as KV_TRANSPORTS

OVERLAP_CHOICES = ("auto", "on", "off")
DEFAULT_KV_CACHE_BYTES = 1 << 30  # on CPU, when neither --kv-cache-bytes nor --num-blocks is given
# Rows of one decode step at most: far past any batch a step is worth running at.
_MAX_RUNNING = 1 << 16


@dataclass(frozen=True)
class DecodeConfig:
    """What a decode instance runs and how much it may hold."""

    model_dir: Path
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Bound on admitted requests (waiting for KV + running). Every admitted request already holds
    # its blocks, so with this bound a request whose KV lands always joins the very next step:
    # there is no second queue between "KV landed" and "running". Also the largest decode batch,
    # so the largest CUDA graph.
    max_running: int = 64
    kv_lease_ms: int = 30_000  # default lease; a GenerateRequest may ask for another
    retry_after_s: float = 0.5  # RetryInfo hint sent with RESOURCE_EXHAUSTED
    # Keep finished requests' full blocks (prompt and output) for later prompts that share
    # their prefix: prefill then sends only the rest (services/decode/requests.py).
    prefix_caching: bool = True
    # How prefill's KV bytes may arrive (mili.kv_handoff.kv_transport.CHOICES): auto offers the
    # same-host transports too (on the CPU the KV pool then lives in shared memory).
    kv_transport: str = "auto"
    host_id: str | None = None  # None: this host's (tests inject others)
    # Launch each decode step before the previous one's ids reach the host (OVERLAP_CHOICES;
    # services/decode/batcher.py): auto = on CUDA, where the host's work between steps then
    # runs while the device computes; on the CPU the host is the device, so it gains nothing.
    # Checked at start-up (mili/engine/step/ahead_check.py): off, with a warning, if it fails.
    overlap_steps: str = "auto"

    def __post_init__(self) -> None:
        # (2^40 hung start-up: the CUDA-graph batch sizes are listed up to it)
        if not 0 < self.max_running <= _MAX_RUNNING:
            raise ValueError(
                f"--max-running must be in [1, {_MAX_RUNNING}], got {self.max_running}"
            )
        if not 0 < self.kv_lease_ms < 2**32:  # Admitted.kv_lease_ms is a uint32
            raise ValueError(f"--kv-lease-ms must be in (0, 2^32), got {self.kv_lease_ms}")
        if self.kv_transport not in KV_TRANSPORTS:
            choices = ", ".join(KV_TRANSPORTS)
            raise ValueError(f"--kv-transport must be one of {choices}, got {self.kv_transport!r}")
        if self.overlap_steps not in OVERLAP_CHOICES:
            choices = ", ".join(OVERLAP_CHOICES)
            raise ValueError(
                f"--overlap-steps must be one of {choices}, got {self.overlap_steps!r}"
            )

    @property
    def overlaps_steps(self) -> bool:
        """Whether the batcher overlaps decode steps (`overlap_steps`, resolved)."""
        if self.overlap_steps == "auto":
            return self.engine.is_cuda
        return self.overlap_steps == "on"

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: Path) -> DecodeConfig:
        return cls(
            model_dir=model_dir,
            engine=EngineConfig.from_args(args),
            max_running=args.max_running,
            kv_lease_ms=args.kv_lease_ms,
            prefix_caching=args.prefix_caching,
            kv_transport=args.kv_transport,
            host_id=args.host_id,
            overlap_steps=args.overlap_steps,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode flags (the shared server and model flags come from mili.flags)."""
    defaults = DecodeConfig(model_dir=Path("."))
    add_engine_arguments(parser, default_pool=f"{DEFAULT_KV_CACHE_BYTES} bytes")
    parser.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="most requests admitted at once, waiting for KV or decoding; also the largest "
        "decode batch and CUDA graph (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-lease-ms",
        type=int,
        default=defaults.kv_lease_ms,
        help="how long a reservation waits for prefill's KV (default: %(default)s)",
    )
    parser.add_argument(
        "--overlap-steps",
        default=defaults.overlap_steps,
        choices=OVERLAP_CHOICES,
        help="launch each decode step before the previous step's tokens reach the host, so "
        "the host's work between steps overlaps the device's; auto = on CUDA "
        "(default: %(default)s)",
    )
    flags.add_transport_arguments(parser)
