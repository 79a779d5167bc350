"""The decode service's configuration: one frozen dataclass, built once from CLI flags.

Torch-free on purpose: `mili --help` builds every service's parser, and the parser's defaults
come from here.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from kernels import ATTENTION_CHOICES, DEFAULT_ATTENTION
from mili.engine.kv_layout import DEFAULT_BLOCK_SIZE, DTYPES

ATTENTION_BACKENDS = ATTENTION_CHOICES
DEFAULT_KV_CACHE_BYTES = 1 << 30  # when neither --kv-cache-bytes nor --num-blocks is given
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class DecodeConfig:
    """What a decode instance runs and how much it may hold.

    The KV pool is sized by `num_blocks` when set, else by `kv_cache_bytes` (divided by the
    bytes one block takes across all layers, K and V).
    """

    model_dir: Path
    device: str = "cpu"
    dtype: str | None = None  # None: the checkpoint's torch_dtype
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    num_blocks: int | None = None
    # Bound on admitted requests (waiting for KV + running). Every admitted request already holds
    # its blocks, so with this bound a request whose KV lands always joins the very next step:
    # there is no second queue between "KV landed" and "running".
    max_running: int = 64
    kv_lease_ms: int = 30_000  # default lease; a GenerateRequest may ask for another
    attention: str = DEFAULT_ATTENTION  # auto: Mojo kernels where they build, else torch
    retry_after_s: float = 0.5  # RetryInfo hint sent with RESOURCE_EXHAUSTED

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size <= 0:
            raise ValueError(f"--block-size must be > 0, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"--kv-cache-bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"--num-blocks must be > 0, got {self.num_blocks}")
        if self.max_running <= 0:
            raise ValueError(f"--max-running must be > 0, got {self.max_running}")
        if self.kv_lease_ms <= 0:
            raise ValueError(f"--kv-lease-ms must be > 0, got {self.kv_lease_ms}")
        if self.attention not in ATTENTION_BACKENDS:
            choices = ", ".join(ATTENTION_BACKENDS)
            raise ValueError(f"--attention must be one of {choices}, got {self.attention!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_dir: Path) -> DecodeConfig:
        return cls(
            model_dir=model_dir,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes
            if args.kv_cache_bytes is not None
            else DEFAULT_KV_CACHE_BYTES,
            num_blocks=args.num_blocks,
            max_running=args.max_running,
            kv_lease_ms=args.kv_lease_ms,
            attention=args.attention,
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode-specific flags (the shared server and model flags come from mili.flags)."""
    defaults = DecodeConfig(model_dir=Path("."))
    parser.add_argument("--device", default=defaults.device, help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="weights and KV element type (default: the fastest on the device: float32 on "
        "CPU, bfloat16 on CUDA)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_size,
        help="tokens per KV block; prefill must use the same (default: %(default)s)",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"KV pool size in bytes (default: {DEFAULT_KV_CACHE_BYTES})",
    )
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    parser.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="most requests admitted at once, waiting for KV or decoding (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-lease-ms",
        type=int,
        default=defaults.kv_lease_ms,
        help="how long a reservation waits for prefill's KV (default: %(default)s)",
    )
    parser.add_argument(
        "--attention",
        default=defaults.attention,
        choices=ATTENTION_BACKENDS,
        help="attention backend: mojo kernels, the torch reference, or auto = mojo where the "
        "kernels build for the device, else torch (default: %(default)s)",
    )
